"""Exercise checks for chapter 02 (self-attention).

* 02.1 ``check_query_gradient``: ``dL/dq`` of one attention head, by hand (the softmax's Jacobian from
  the chapter, applied through the chain rule), against autograd, with autograd refused to the answer.
* 02.2 ``check_fuse_qkv``: the three projections of a :class:`attnlib.SelfAttentionV2`
  fused into one ``nn.Linear(d_model, 3 * head_dim)``.
* 02.3 ``check_score_variance``: an empirical estimate of the variance of ``q·k``
  before and after dividing by ``sqrt(head_dim)``, drawn from the given generator.

Every check runs the answer through :func:`~attnlib.book.exercises._run.run` on fixed edge cases and
fresh random ones (:func:`~attnlib.book.exercises._core.case_rng`); the expected values are computed
after the answer ran, in float64 (02.1 with autograd, 02.2 from the head's own weights).
"""
from __future__ import annotations

import math

import torch
import torch.autograd.functional
import torch.func
from torch import nn

from attnlib.attention import SelfAttentionV2
from attnlib.book.exercises._autograd import AUTOGRAD, GraphWatch
from attnlib.book.exercises._core import (
    case_rng,
    exercise,
    expect,
    expect_close,
    expect_number,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import Refuse, run

__all__ = ["check_query_gradient", "check_fuse_qkv", "check_score_variance"]


# --------------------------------------------------------------------------- 02.1

_BY_HAND = Refuse(
    "compute the gradient by hand, without autograd", *AUTOGRAD)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)  # (..., T_q, T_k)
    return weights @ v, weights  # (..., T_q, d_v)


def _expected_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """dL/dq for L = sum(out * g), by autograd in float64 (independent of the hints' formulas)."""
    q64 = q.double().requires_grad_()
    with torch.enable_grad():
        out, _ = _forward(q64, k.double(), v.double(), 1 / math.sqrt(q.shape[-1]))
        (grad,) = torch.autograd.grad((out * g.double()).sum(), q64)
    return grad


def _mistakes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the usual slips of the chain rule give, most specific first."""
    q, k, v, g = q.double(), k.double(), v.double(), g.double()
    scale = 1 / math.sqrt(q.shape[-1])
    _, a = _forward(q, k, v, scale)
    d_a = g @ v.transpose(-2, -1)  # (..., T_q, d_v) @ (..., d_v, T_k) -> (..., T_q, T_k): dL/dalpha
    d_s = a * (d_a - (a * d_a).sum(-1, keepdim=True))  # softmax's Jacobian, row by row
    _, a_raw = _forward(q, k, v, 1.0)
    d_a_raw = a_raw * (d_a - (a_raw * d_a).sum(-1, keepdim=True))
    return {
        "the factor 1/sqrt(head_dim) is missing: s = q . k / sqrt(head_dim), so ds/dq = k / sqrt(head_dim)":
            d_s @ k,
        "the scores must be divided by sqrt(head_dim) (in the weights and in ds/dq)": d_a_raw @ k,
        "the softmax's Jacobian is diag(alpha) - alpha alpha^T: you kept only its diagonal, alpha * dL/dalpha; "
        "subtract each row's weighted mean sum_n alpha_n dL/dalpha_n first": (a * d_a) @ k * scale,
        "you skipped the softmax: dL/ds is not dL/dalpha; multiply by the softmax's Jacobian "
        "diag(alpha) - alpha alpha^T": d_a @ k * scale,
        "the weighted mean in the softmax's Jacobian runs over the keys of each query (dim=-1), not over "
        "the queries": (a * (d_a - (a * d_a).sum(-2, keepdim=True))) @ k * scale,
    }


def _gradient_cases(g: torch.Generator) -> list[tuple[tuple[int, ...], int, int, int, int]]:
    """(leading dims, T_q, T_k, head_dim, head_dim_v)."""
    cases = [((), 3, 5, 4, 2), ((2,), 4, 6, 8, 8), ((2, 3), 2, 7, 16, 5),
             ((), 3, 1, 4, 3),  # a single key: its weight is 1 whatever q, so dL/dq = 0
             ((1,), 1, 4, 6, 6)]
    for _ in range(3):
        lead = tuple(randint(g, 1, 3) for _ in range(randint(g, 0, 2)))
        cases.append((lead, randint(g, 1, 6), randint(g, 2, 8), randint(g, 2, 12), randint(g, 1, 6)))
    return cases


@exercise("02.1")
def check_query_gradient(fn) -> None:
    """Grade ``fn(q, k, v, g) -> dL/dq`` for ``L = sum(softmax(q k^T / sqrt(d)) v * g)``, against autograd."""
    rng = case_rng()
    for lead, T_q, T_k, head_dim, head_dim_v in _gradient_cases(rng):
        q = 1.5 * torch.randn(*lead, T_q, head_dim, generator=rng)  # scores of spread ~1.5: a sharp softmax
        k = torch.randn(*lead, T_k, head_dim, generator=rng)
        v = torch.randn(*lead, T_k, head_dim_v, generator=rng)
        g = torch.randn(*lead, T_q, head_dim_v, generator=rng)
        what = (f"query_gradient(q, k, v, g) for q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                f"g {tuple(g.shape)}")
        watch = GraphWatch()
        grad = run(fn, q, k, v, g, what=what, refuse=_BY_HAND, inside=(watch,))
        expect(not watch.recorded,
               f"{what}: compute the gradient by hand, without autograd: your code recorded an autograd graph "
               "(requires_grad on a tensor); write the chain rule out with matmuls")
        if isinstance(grad, torch.Tensor) and tuple(grad.shape) == (*lead, T_k, head_dim) and T_k != T_q:
            expect(False, f"{what}: your result has the shape of k, {tuple(k.shape)}; dL/dq has the shape of q")
        expect_tensor(grad, what, shape=tuple(q.shape), dtype=q.dtype)
        expected = _expected_grad(q, k, v, g)
        if T_k == 1:
            expect(bool(grad.abs().max() < 1e-6),
                   f"{what}: with a single key its weight is 1 whatever the query, so dL/dq must be 0; "
                   "the softmax's Jacobian diag(alpha) - alpha alpha^T is 0 there")
        if not torch.allclose(grad.double(), expected, atol=1e-5, rtol=1e-4):
            for hint, wrong in _mistakes(q, k, v, g).items():
                expect(not torch.allclose(grad.double(), wrong, atol=1e-5, rtol=1e-4), f"{what}: {hint}")
        expect_close(grad, expected, f"{what} (compared with autograd)")


# --------------------------------------------------------------------------- 02.2


def _random_head(d_model: int, head_dim: int, bias: bool, g: torch.Generator) -> SelfAttentionV2:
    """A SelfAttentionV2 whose weights (and biases, of size ~1 so that a missing one shows) come from ``g``."""
    head = SelfAttentionV2(d_model, head_dim, bias=bias)
    with torch.no_grad():
        for linear in (head.W_query, head.W_key, head.W_value):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) / math.sqrt(d_model))
            if bias:
                linear.bias.copy_(torch.randn(linear.bias.shape, generator=g))
    return head


@exercise("02.2")
def check_fuse_qkv(fn) -> None:
    """Grade ``fn(sa_v2) -> nn.Linear(d_model, 3 * head_dim)`` whose output splits into q, k, v."""
    rng = case_rng()
    # fixed edges: square heads (d_model == head_dim), where a transposed weight still fits; no bias; bias
    cases = [(4, 4, True), (3, 3, False), (6, 4, False), (5, 3, True)]
    cases += [(randint(rng, 2, 8), randint(rng, 1, 6), bool(randint(rng, 0, 1))) for _ in range(3)]
    for d_model, head_dim, bias in cases:
        head = _random_head(d_model, head_dim, bias, rng)
        what = f"fuse_qkv(SelfAttentionV2({d_model}, {head_dim}, bias={bias}))"
        fused = run(fn, head, what=what)
        expect(type(fused) is nn.Linear,
               f"{what} should return an nn.Linear (exactly: a subclass can change what forward computes), "
               f"got {type(fused).__module__}.{type(fused).__qualname__}")
        expect(fused.in_features == d_model and fused.out_features == 3 * head_dim,
               f"{what}: the Linear should map {d_model} -> {3 * head_dim} features; yours maps "
               f"{fused.in_features} -> {fused.out_features}")
        weight = expect_tensor(fused.weight, f"the weight of {what}", dtype=torch.float32)
        expect(tuple(weight.shape) == (3 * head_dim, d_model),
               f"{what}: weight has shape {tuple(weight.shape)}, expected {(3 * head_dim, d_model)}: nn.Linear "
               "stores (out_features, in_features), so stack the three weights along dim 0")
        if bias:
            expect(fused.bias is not None, f"{what}: the head's projections have biases, so the fused Linear "
                                           "needs one too (bias=True, the three biases concatenated)")
            expect_tensor(fused.bias, f"the bias of {what}", shape=(3 * head_dim,), dtype=torch.float32)
        else:
            expect(fused.bias is None, f"{what}: the head's projections have no bias, so the fused Linear should "
                                       "have none (bias=False)")
        x = torch.randn(2, 5, d_model, generator=rng).double()
        out = x @ weight.detach().double().T  # (B, T, d_model) @ (d_model, 3*head_dim): what fused(x) computes
        if fused.bias is not None:
            out = out + fused.bias.detach().double()
        parts = {name: getattr(head, f"W_{name}") for name in ("query", "key", "value")}
        wanted = {name: x @ p.weight.detach().double().T + (0 if p.bias is None else p.bias.detach().double())
                  for name, p in parts.items()}
        for name, got in zip(wanted, out.split(head_dim, dim=-1)):  # 3 x (B, T, head_dim)
            if torch.allclose(got, wanted[name], atol=1e-6):
                continue
            swapped = [o for o, t in wanted.items() if o != name and torch.allclose(got, t, atol=1e-6)]
            expect(not swapped, f"{what}: the {name} block of the output equals W_{swapped[0] if swapped else ''}(x): "
                                "stack the rows in the order [W_query; W_key; W_value]")
            p = parts[name]
            if d_model == head_dim:
                transposed = x @ p.weight.detach().double() + (0 if p.bias is None else p.bias.detach().double())
                expect(not torch.allclose(got, transposed, atol=1e-6),
                       f"{what}: the {name} block holds W_{name}.weight transposed; nn.Linear's weight is already "
                       "(out_features, in_features), copy it as it is (a square head hides the mistake in the "
                       "shapes)")
            expect_close(got, wanted[name], f"the {name} block of {what}(x) (compared with sa_v2.W_{name}(x): "
                                            "the fused layer must hold the head's own weights)")


# --------------------------------------------------------------------------- 02.3


def _pair(answer: object, what: str) -> tuple[float, float]:
    expect(type(answer) in (tuple, list) and len(answer) == 2,
           f"{what} should return a pair (var_unscaled, var_scaled), got {type(answer).__name__}")
    return expect_number(answer[0], f"var_unscaled of {what}"), expect_number(answer[1], f"var_scaled of {what}")


@exercise("02.3")
def check_score_variance(fn) -> None:
    """Grade ``fn(head_dim, n, std, generator) -> (var_unscaled, var_scaled)``: about head_dim·std⁴ and std⁴."""
    n, rel_tol = 20_000, 0.1  # the estimate's relative spread is at most about sqrt(8 / n) = 2%
    rng = case_rng()
    cases = [(4, 1.0), (64, 1.0), (32, 2.0), (8, 0.5)]
    cases += [(randint(rng, 2, 48), round(0.3 + 2.5 * torch.rand((), generator=rng).item(), 2)) for _ in range(2)]
    for head_dim, std in cases:
        seed = randint(rng, 0, 2**40)
        what = f"estimate_score_variance({head_dim}, {n}, {std}, generator)"
        unscaled, scaled = _pair(run(fn, head_dim, n, std, torch.Generator().manual_seed(seed), what=what), what)
        want_unscaled, want_scaled = head_dim * std**4, std**4
        where = f"{what}: "
        expect(not math.isclose(scaled, want_scaled / head_dim, rel_tol=rel_tol),
               f"{where}var_scaled = {scaled:.3g} = std^4 / head_dim: you divided the dot products by head_dim; "
               "divide by sqrt(head_dim)")
        expect(std == 1.0 or not math.isclose(unscaled, head_dim, rel_tol=rel_tol),
               f"{where}var_unscaled = {unscaled:.3g}, about head_dim: your entries have standard deviation 1; "
               "multiply them by std")
        expect(math.isclose(unscaled, want_unscaled, rel_tol=rel_tol),
               f"{where}var_unscaled = {unscaled:.3g}, expected about head_dim * std^4 = {want_unscaled:.3g} "
               "(draw entries with mean 0 and standard deviation std, e.g. std * torch.randn(...), and take "
               "the variance of the n dot products q_i . k_i)")
        expect(math.isclose(scaled, want_scaled, rel_tol=rel_tol),
               f"{where}var_scaled = {scaled:.3g}, expected about std^4 = {want_scaled:.3g} (the variance of "
               "the dot products divided by sqrt(head_dim))")
        again = _pair(run(fn, head_dim, n, std, torch.Generator().manual_seed(seed), what=what), what)
        expect(again == (unscaled, scaled),
               f"{where}two generators with the same seed gave different numbers ({unscaled:.4g} and "
               f"{again[0]:.4g}): draw every sample with the generator argument (torch.randn(..., "
               "generator=generator)), so that a run can be repeated")
        other = _pair(run(fn, head_dim, n, std, torch.Generator().manual_seed(seed + 1), what=what), what)
        expect(other != (unscaled, scaled),
               f"{where}two different generators gave exactly the same numbers: estimate the variances from "
               "random samples drawn with the generator argument, do not return the formula")
