"""Exercise checks for chapter 02 (self-attention).

* 02.1 ``check_attention``: scaled dot-product attention written by hand, against
  :func:`torch.nn.functional.scaled_dot_product_attention`.
* 02.2 ``check_fuse_qkv``: the three projections of a :class:`attnlib.SelfAttentionV2`
  fused into one ``nn.Linear(d_model, 3 * head_dim)``.
* 02.3 ``check_score_variance``: an empirical estimate of the variance of ``q·k``
  before and after dividing by ``sqrt(head_dim)``.

Every grader draws its inputs from a local :class:`torch.Generator`; ``grade`` runs it
inside :func:`torch.random.fork_rng`, so checking an answer never changes what a
notebook samples next.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

import attnlib.attention
import attnlib.attention.functions
from attnlib.attention import SelfAttentionV2
from attnlib.book.exercises._core import Wrong, exercise, expect, expect_close

__all__ = ["check_attention", "check_fuse_qkv", "check_score_variance"]


# --------------------------------------------------------------------------- 02.1


@contextlib.contextmanager
def _library_attention_forbidden() -> Iterator[None]:
    """Make the ready-made attention functions raise :class:`Wrong` while the answer runs."""

    def refuse(name: str):
        def call(*args, **kwargs):
            raise Wrong(f"write the computation by hand: your function called {name}")

        return call

    # attnlib.attention re-exports attnlib.attention.functions.attention: refuse it under both names.
    saved = F.scaled_dot_product_attention, attnlib.attention.attention, attnlib.attention.functions.attention
    F.scaled_dot_product_attention = refuse("F.scaled_dot_product_attention")
    attnlib.attention.attention = attnlib.attention.functions.attention = refuse("attnlib.attention.attention")
    try:
        yield
    finally:
        F.scaled_dot_product_attention, attnlib.attention.attention, attnlib.attention.functions.attention = saved


def _common_mistake(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Name the usual mistake ``out`` matches, if any."""
    head_dim = q.shape[-1]
    scores = q @ k.transpose(-2, -1)  # (..., T_q, head_dim) @ (..., head_dim, T_k) -> (..., T_q, T_k)
    candidates = {
        "the scores were not divided by sqrt(head_dim)": torch.softmax(scores, dim=-1) @ v,
        "the scores were divided by head_dim; divide by sqrt(head_dim)": torch.softmax(scores / head_dim, dim=-1) @ v,
        "the softmax ran over the queries (dim=-2); it must run over the keys (dim=-1), "
        "so that each query's weights sum to 1": torch.softmax(scores / math.sqrt(head_dim), dim=-2) @ v,
        "the softmax was applied after multiplying by v; softmax the scores first, then take "
        "the weighted sum of the values": torch.softmax((scores / math.sqrt(head_dim)) @ v, dim=-2),
    }
    for hint, wrong in candidates.items():
        if wrong.shape == out.shape and torch.allclose(out.detach().double(), wrong.double(), atol=1e-5):
            return hint
    return None


_ATTENTION_SHAPES = (
    # (q shape, k shape, v shape): a plain (T, head_dim) case, a batch with T_q != T_k and
    # head_dim_v != head_dim, and (B, n_heads, T, head_dim) with a head_dim that is no square.
    ((5, 4), (5, 4), (5, 4)),
    ((2, 3, 6), (2, 7, 6), (2, 7, 5)),
    ((2, 3, 4, 10), (2, 3, 9, 10), (2, 3, 9, 10)),
)


@exercise("02.1")
def check_attention(fn) -> None:
    """Grade ``fn(q, k, v) -> output`` against ``F.scaled_dot_product_attention`` on random shapes."""
    g = torch.Generator().manual_seed(201)
    for q_shape, k_shape, v_shape in _ATTENTION_SHAPES:
        q, k, v = (torch.randn(*shape, generator=g) for shape in (q_shape, k_shape, v_shape))
        with _library_attention_forbidden():
            try:
                out = fn(q.clone(), k.clone(), v.clone())
            except (NotImplementedError, Wrong):
                raise
            except Exception as e:
                raise Wrong(
                    f"for q {q_shape}, k {k_shape}, v {v_shape} your code raised {type(e).__name__}: {e} "
                    "(k.T reverses every dimension; k.transpose(-2, -1) swaps only the last two)"
                ) from None
        expect(
            not isinstance(out, tuple),
            "return only the output tensor softmax(q k^T / sqrt(head_dim)) v, not a tuple",
        )
        expected = F.scaled_dot_product_attention(q, k, v)
        expect(isinstance(out, torch.Tensor), f"return a torch.Tensor, got {type(out).__name__}")
        expect(
            tuple(out.shape) == tuple(expected.shape),
            f"for q {q_shape}, k {k_shape}, v {v_shape} the output has shape {tuple(out.shape)}, expected "
            f"{tuple(expected.shape)} (..., T_q, head_dim_v); use k.transpose(-2, -1), not k.T, so leading "
            "dimensions are kept",
        )
        mistake = _common_mistake(out, q, k, v)
        expect(mistake is None, f"for q {q_shape}: {mistake}")
        expect_close(out, expected, f"the output for q {q_shape}, k {k_shape}, v {v_shape}")


# --------------------------------------------------------------------------- 02.2


def _random_head(d_model: int, head_dim: int, bias: bool, seed: int) -> SelfAttentionV2:
    """A SelfAttentionV2 with seeded weights (graders run inside grade()'s RNG fork, so the notebook's state is kept)."""
    torch.manual_seed(seed)
    head = SelfAttentionV2(d_model, head_dim, bias=bias)
    if bias:  # nn.Linear draws small biases; make them large enough that a missing one shows
        with torch.no_grad():
            for linear in (head.W_query, head.W_key, head.W_value):
                linear.bias.normal_()
    return head


@exercise("02.2")
def check_fuse_qkv(fn) -> None:
    """Grade ``fn(sa_v2) -> nn.Linear(d_model, 3 * head_dim)`` whose output splits into q, k, v."""
    g = torch.Generator().manual_seed(202)
    for seed, (d_model, head_dim, bias) in enumerate(((6, 4, False), (5, 3, True), (4, 4, True))):
        head = _random_head(d_model, head_dim, bias, seed)
        fused = fn(head)
        expect(isinstance(fused, nn.Linear), f"return an nn.Linear, got {type(fused).__name__}")
        expect(
            fused.in_features == d_model and fused.out_features == 3 * head_dim,
            f"for d_model={d_model}, head_dim={head_dim} the Linear should map {d_model} -> {3 * head_dim} "
            f"features; yours maps {fused.in_features} -> {fused.out_features}",
        )
        expect(
            tuple(fused.weight.shape) == (3 * head_dim, d_model),
            f"weight has shape {tuple(fused.weight.shape)}, expected {(3 * head_dim, d_model)}: nn.Linear stores "
            "(out_features, in_features), so stack the three weights along dim 0",
        )
        if bias:
            expect(
                fused.bias is not None,
                "the head's projections have biases, so the fused Linear needs one too (bias=True, the three "
                "biases concatenated)",
            )
        else:
            expect(fused.bias is None, "the head's projections have no bias, so the fused Linear should have none")

        x = torch.randn(2, 5, d_model, generator=g)
        with torch.no_grad():
            q, k, v = fused(x).split(head_dim, dim=-1)  # (B, T, 3*head_dim) -> 3 x (B, T, head_dim)
            wanted = {"query": head.W_query(x), "key": head.W_key(x), "value": head.W_value(x)}
            for name, got in zip(wanted, (q, k, v)):
                if torch.allclose(got, wanted[name], atol=1e-6):
                    continue
                swapped = [other for other, t in wanted.items() if other != name and torch.allclose(got, t, atol=1e-6)]
                expect(
                    not swapped,
                    f"the {name} block of the output equals W_{swapped[0] if swapped else ''}(x): stack the rows "
                    "in the order [W_query; W_key; W_value]",
                )
                expect_close(got, wanted[name], f"the {name} block of fused(x) (compared with sa_v2.W_{name}(x))")
            expect_close(
                attnlib.attention.attention(q, k, v)[0], head(x), "attention on the fused q, k, v (compared with sa_v2(x))"
            )


# --------------------------------------------------------------------------- 02.3


def _as_float(value, what: str) -> float:
    if isinstance(value, torch.Tensor):
        expect(value.numel() == 1, f"{what} should be one number, got a tensor of shape {tuple(value.shape)}")
        return float(value.item())
    expect(isinstance(value, (int, float)), f"{what} should be a number, got {type(value).__name__}")
    return float(value)


@exercise("02.3")
def check_score_variance(fn) -> None:
    """Grade ``fn(head_dim, n, std, generator) -> (var_unscaled, var_scaled)``: about head_dim·std⁴ and std⁴."""
    n, rel_tol = 20_000, 0.1  # the estimate's relative spread is about sqrt(2 / n) = 1%
    for seed, (head_dim, std) in enumerate(((4, 1.0), (64, 1.0), (32, 2.0), (8, 0.5))):
        answer = fn(head_dim, n, std, torch.Generator().manual_seed(203 + seed))
        expect(
            isinstance(answer, (tuple, list)) and len(answer) == 2,
            f"return a pair (var_unscaled, var_scaled), got {type(answer).__name__}",
        )
        unscaled = _as_float(answer[0], "var_unscaled")
        scaled = _as_float(answer[1], "var_scaled")
        want_unscaled, want_scaled = head_dim * std**4, std**4
        where = f"for head_dim={head_dim}, std={std}"
        expect(
            not math.isclose(scaled, want_scaled / head_dim, rel_tol=rel_tol) or head_dim == 1,
            f"{where} var_scaled = {scaled:.3g} = std^4 / head_dim: you divided the dot products by head_dim; "
            "divide by sqrt(head_dim)",
        )
        expect(
            std == 1.0 or not math.isclose(unscaled, head_dim, rel_tol=rel_tol),
            f"{where} var_unscaled = {unscaled:.3g}, about head_dim: your entries have standard deviation 1; "
            "multiply them by std",
        )
        expect(
            math.isclose(unscaled, want_unscaled, rel_tol=rel_tol),
            f"{where} var_unscaled = {unscaled:.3g}, expected about head_dim * std^4 = {want_unscaled:.3g} "
            "(draw entries with mean 0 and standard deviation std, e.g. std * torch.randn(...), and take "
            "the variance of the n dot products q_i . k_i)",
        )
        expect(
            math.isclose(scaled, want_scaled, rel_tol=rel_tol),
            f"{where} var_scaled = {scaled:.3g}, expected about std^4 = {want_scaled:.3g} (the variance of "
            "the dot products divided by sqrt(head_dim))",
        )
    again = fn(8, n, 0.5, torch.Generator().manual_seed(303))
    expect(
        (_as_float(again[0], "var_unscaled"), _as_float(again[1], "var_scaled")) != (unscaled, scaled),
        "two different generators gave exactly the same numbers: estimate the variances from random samples "
        "drawn with the generator argument, do not return the formula",
    )
