"""Exercise 18.4: the gated delta rule, chunked, from a given state.

``gated_delta_chunked(q, k, v, beta, g, initial_state, chunk_size) -> (output, state)`` with q, k
``(B, h, T, d_k)`` (unit-length keys), v ``(B, h, T, d_v)``, beta, g ``(B, h, T)``, the state
``(B, h, d_k, d_v)``: ``S_t = e^{g_t} (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``,
``o_t = S_tᵀ q_t / √d_k``. Checked against a token-by-token loop in float64 on fixed and fresh
random sizes (a chunk longer than the sequence, chunks of 1, a last chunk shorter, a decay strong
enough that ``e^{γ_r}`` underflows over a chunk); attnlib's ``gated_delta_rule`` and transformers'
Qwen3-Next references are refused; an answer that updates the state token by token is refused
(its state-shaped operations are counted).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import attnlib.attention.deltanet as deltanet
from attnlib.book.exercises._core import NotSolved, case_rng, exercise, expect, expect_tensor, randint
from attnlib.book.exercises._run import Refuse, run

__all__ = ["StateOps", "check_gated_delta_chunked"]


class StateOps(TorchDispatchMode):
    """Counts the operations whose result has a state's shape ``(..., d_k, d_v)`` (either order)."""

    def __init__(self, d_k: int, d_v: int) -> None:
        super().__init__()
        self.shapes, self.count = {(d_k, d_v), (d_v, d_k)}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) in self.shapes
               for t in tree_leaves(out)):
            self.count += 1
        return out


def _refused() -> Refuse:
    targets = [deltanet.gated_delta_rule, deltanet._chunked, deltanet._recurrent, deltanet.GatedDeltaNet]
    try:  # the chapter imports transformers' references; a learner may reach for them
        from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next
    except ImportError:  # pragma: no cover - transformers is a dependency of the book
        qwen3_next = None
    if qwen3_next is not None:
        targets += [qwen3_next.torch_chunk_gated_delta_rule, qwen3_next.torch_recurrent_gated_delta_rule]
    return Refuse("write the chunked form yourself, not with attnlib's gated_delta_rule or transformers' "
                  "Qwen3-Next references", *targets)


def _loop(q, k, v, beta, g, S):
    """The recurrence one token at a time (float64): forget, write the correction, read."""
    outs = []
    for t in range(q.shape[2]):
        S = g[:, :, t, None, None].exp() * S
        read = torch.einsum("bhk,bhkv->bhv", k[:, :, t], S)  # Sᵀ k_t
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], beta[:, :, t, None] * (v[:, :, t] - read))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S) * q.shape[-1] ** -0.5)
    return torch.stack(outs, 2), S


def _cases(g: torch.Generator) -> list[tuple]:
    # (B, h, T, d_k, d_v, chunk_size, log-decay range, a non-zero initial state)
    cases = [(1, 1, 10, 4, 3, 4, (-1.0, 0.0), False), (2, 3, 13, 6, 5, 5, (-1.0, 0.0), True),
             (1, 2, 9, 4, 3, 1, (-0.5, 0.0), True), (2, 1, 7, 4, 5, 16, (-1.0, 0.0), True),
             (1, 2, 40, 4, 3, 32, (-60.0, -30.0), True),  # e^{γ_r} underflows inside one chunk
             (1, 2, 128, 6, 5, 32, (-0.2, 0.0), True)]  # the state updates are counted here
    cases += [(randint(g, 1, 2), randint(g, 1, 3), randint(g, 5, 30), randint(g, 2, 6), randint(g, 2, 6),
               randint(g, 2, 9), (-float(torch.rand((), generator=g)) - 0.1, 0.0), True) for _ in range(3)]
    return cases


@exercise("18.4")
def check_gated_delta_chunked(gated_delta_chunked) -> None:
    """Check ``gated_delta_chunked(q, k, v, beta, g, initial_state, chunk_size) -> (output, state)``."""
    rng, refuse = case_rng(), _refused()
    for B, h, T, d_k, d_v, C, (lo, hi), start in _cases(rng):
        q = torch.randn(B, h, T, d_k, generator=rng, dtype=torch.float64)
        k = F.normalize(torch.randn(B, h, T, d_k, generator=rng, dtype=torch.float64), dim=-1)
        v = torch.randn(B, h, T, d_v, generator=rng, dtype=torch.float64)
        beta = torch.rand(B, h, T, generator=rng, dtype=torch.float64)
        g = lo + (hi - lo) * torch.rand(B, h, T, generator=rng, dtype=torch.float64)
        S0 = torch.randn(B, h, d_k, d_v, generator=rng, dtype=torch.float64) * float(start)
        what = (f"gated_delta_chunked(q, k, v, beta, g, initial_state, chunk_size={C}) with B={B}, h={h}, T={T}, "
                f"d_k={d_k}, d_v={d_v}, g in [{lo:.2g}, {hi:.2g}]")
        counter = StateOps(d_k, d_v)
        got = run(gated_delta_chunked, q, k, v, beta, g, S0, C, what=what, refuse=refuse, inside=(counter,))
        if got is None:
            raise NotSolved("return the pair (output, state), not None")
        expect(type(got) in (tuple, list) and len(got) == 2,
               f"{what}: return a pair (output (B, h, T, d_v), state (B, h, d_k, d_v)); got {type(got).__name__}")
        out, S = got
        if isinstance(out, torch.Tensor) and isinstance(S, torch.Tensor):
            expect(not (tuple(out.shape) == (B, h, d_k, d_v) and tuple(S.shape) == (B, h, T, d_v)),
                   f"{what}: you returned (state, output); return (output, state) in this order")
        expect_tensor(out, f"{what}: the output", shape=(B, h, T, d_v))
        expect_tensor(S, f"{what}: the state", shape=(B, h, d_k, d_v))
        want_out, want_S = _loop(q, k, v, beta, g, S0)
        expect(not (out.isnan().any() or S.isnan().any()),
               f"{what}: your result holds NaN: over a chunk the cumulative log decay gamma_r falls below the "
               "smallest float's logarithm, exp(gamma_r) is 0 and exp(gamma_r) / exp(gamma_s) is 0 / 0; "
               "compute the decay between two positions as exp(gamma_r - gamma_s)")
        ok_out = torch.allclose(out.double(), want_out, rtol=1e-8, atol=1e-10)
        ok_S = torch.allclose(S.double(), want_S, rtol=1e-8, atol=1e-10)
        if ok_out and ok_S:
            chunks = -(-T // C)
            expect(T < 128 or counter.count <= 20 * chunks + 20,
                   f"{what}: {counter.count} operations gave a state-shaped (d_k, d_v) result for {chunks} chunks: "
                   "your code updates the state token by token; solve each chunk's corrections at once (the "
                   "UT transform) and update the state once per chunk")
            continue
        expect(not torch.allclose(out.double(), want_out * d_k**0.5, rtol=1e-8, atol=1e-10),
               f"{what}: the output is S_t^T q_t / sqrt(d_k): scale the queries by 1/sqrt(d_k)")
        if start:
            cold_out, cold_S = _loop(q, k, v, beta, g, torch.zeros_like(S0))
            expect(not torch.allclose(out.double(), cold_out, rtol=1e-8, atol=1e-10),
                   f"{what}: you started from a zero state; the first chunk starts from initial_state "
                   "(U = U_0 - W S_0, and the read (Q * e^gamma) S_0)")
        first = min(C, T)
        if T > C and torch.allclose(out[:, :, :first].double(), want_out[:, :, :first], rtol=1e-8, atol=1e-10):
            expect(False, f"{what}: the first chunk is right but a later one is not: carry the state; the "
                          "state leaving a chunk, e^(gamma_C) S_0 + (K * e^(gamma_C - gamma))^T U, enters the next")
        expect(ok_out, f"{what}: the output differs from the recurrence by "
                       f"{(out.double() - want_out).abs().max().item():.3g}")
        expect(False, f"{what}: the outputs are right but the final state differs from the recurrence's by "
                      f"{(S.double() - want_S).abs().max().item():.3g}: S_C = e^(gamma_C) S_0 + "
                      "(K * e^(gamma_C - gamma))^T U after the last (possibly shorter) chunk")
