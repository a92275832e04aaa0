"""Exercise checks for chapter 18 (beyond softmax).

* 18.1 ``check_retention_chunked``: ``retention_chunked(q, k, v, gamma, chunk_size)``, the chunked
  form of linear attention with a constant decay (RetNet's retention, Sun et al. 2023):
  ``S_t = γ S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t``, checked against the token-by-token recurrence
  on fixed and fresh random sizes (to float32 rounding); a wrong answer is probed for reading the
  future; an answer that updates the state token by token is refused (its state-shaped operations
  are counted).
* 18.2 ``check_sparse_decode_step``: ``sparse_decode_step(q, K, V, index_scores, top_k)``, one
  decoding step of top-k attention whose keys are chosen by an indexer's scores (as DeepSeek's
  DSA), checked against dense attention over the chosen keys; attnlib's ``topk_attention`` is
  refused; a wrong answer's weights are read back (one-hot values) to say how many and which keys
  it used, their sum and their scale.
* 18.3 ``check_break_even_length``: ``break_even_length(n_heads, head_dim, n_kv_heads, kv_head_dim)``,
  the shortest sequence whose KV cache (one layer, K and V of ``n_kv_heads`` heads) holds more
  numbers than a gated DeltaNet state (``n_heads · head_dim²``); checked exactly, a Python int.
* 18.4 ``check_gated_delta_chunked`` (in :mod:`._ch18_delta`): the chunked gated delta rule from
  a given state, ``(output, final state)``.

Every call of the learner's code goes through :func:`attnlib.book.exercises._run.run`; the random
cases come from :func:`attnlib.book.exercises._core.case_rng`.
"""
from __future__ import annotations

import torch

from attnlib.attention import TopKAttention, topk_attention, topk_mask
from attnlib.book.exercises._ch18_delta import StateOps, check_gated_delta_chunked  # (registers 18.4)
from attnlib.book.exercises._core import (
    NotSolved,
    Wrong,
    case_rng,
    exercise,
    expect,
    expect_int,
    expect_tensor,
    randint,
)
from attnlib.book.exercises._run import Refuse, run

__all__ = ["check_break_even_length", "check_gated_delta_chunked", "check_retention_chunked",
           "check_sparse_decode_step"]


# ---------------------------------------------------------------- 18.1
def _retention(q, k, v, gamma):
    """The recurrence itself, one token at a time (float64)."""
    S = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[-2]):
        S = gamma * S + k[..., t, :, None] * v[..., t, None, :]
        outs.append((q[..., t, :, None] * S).sum(-2))
    return torch.stack(outs, -2)


def _retention_slip(q, k, v, gamma, C, shift=0, mask=True):
    """The chunked form with a slip inside the chunks (for the hints): decay exponent shifted, or no mask."""
    S = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    outs = []
    for start in range(0, q.shape[-2], C):
        qc, kc, vc = (t[..., start : start + C, :] for t in (q, k, v))
        r = torch.arange(qc.shape[-2], dtype=q.dtype)
        D = gamma ** (r[:, None] - r + shift)
        D = torch.where(r[:, None] >= r, D, torch.zeros_like(D)) if mask else D
        outs.append((qc * gamma ** (r + 1)[:, None]) @ S + ((qc @ kc.transpose(-2, -1)) * D) @ vc)
        S = gamma ** len(r) * S + (kc * gamma ** (len(r) - 1 - r)[:, None]).transpose(-2, -1) @ vc
    return torch.cat(outs, -2)


def _retention_cases(g: torch.Generator) -> list[tuple]:
    cases = [(12, 4, 0.9), (13, 5, 0.7), (16, 16, 0.95), (9, 1, 0.5), (7, 10, 0.8), (64, 16, 0.97)]
    cases += [(randint(g, 5, 40), randint(g, 2, 12), round(0.5 + 0.49 * float(torch.rand((), generator=g)), 3))
              for _ in range(3)]
    return [(randint(g, 1, 3), randint(g, 1, 3), randint(g, 2, 6), randint(g, 2, 6), *c) for c in cases]


@exercise("18.1")
def check_retention_chunked(retention_chunked) -> None:
    """Check ``retention_chunked(q, k, v, gamma, chunk_size) -> (..., T, d_v)`` against the recurrence."""
    g = case_rng()
    for B, h, d_k, d_v, T, C, gamma in _retention_cases(g):
        q, k = (torch.randn(B, h, T, d_k, generator=g, dtype=torch.float64) for _ in range(2))
        v = torch.randn(B, h, T, d_v, generator=g, dtype=torch.float64)
        what = f"retention_chunked(q, k, v, gamma={gamma}, chunk_size={C}) with q, k {(B, h, T, d_k)}, v {(B, h, T, d_v)}"
        counter = StateOps(d_k, d_v)
        got = run(retention_chunked, q, k, v, gamma, C, what=what, inside=(counter,))
        if got is None:
            raise NotSolved("return the output (..., T, d_v), not None")
        expect_tensor(got, what, shape=(B, h, T, d_v), dtype=q.dtype)  # float64 in, float64 out
        expected = _retention(q, k, v, gamma)
        tol = 1e-6 * expected.abs().max().item()  # float32 powers of gamma are fine: the algebra is checked
        if torch.allclose(got.double(), expected, rtol=1e-5, atol=tol):
            chunks = -(-T // C)
            expect(T < 64 or counter.count <= 16 * chunks + 16,
                   f"{what}: {counter.count} operations gave a state-shaped (d_k, d_v) result for {chunks} chunks: "
                   "your code steps token by token; compute each chunk with matrix products and update the "
                   "state once per chunk")
            continue
        expect(not torch.allclose(got.double(), _retention_slip(q, k, v, gamma, C, shift=1), atol=1e-8),
               f"{what}: the weight of key s for query t is gamma**(t - s): a token's own key is not decayed "
               "(you used gamma**(t - s + 1))")
        expect(not torch.allclose(got.double(), _retention_slip(q, k, v, gamma, C, mask=False), atol=1e-8),
               f"{what}: future keys leak in: inside a chunk mask the decay matrix to s <= t (gamma**(t - s) "
               "for s > t is not zero)")
        p = T // 2  # change the keys and values from position p on: the outputs before p must not move
        k2, v2 = k.clone(), v.clone()
        k2[..., p:, :], v2[..., p:, :] = -k2[..., p:, :], 2 * v2[..., p:, :]
        again = expect_tensor(run(retention_chunked, q, k2, v2, gamma, C, what=what), what, shape=(B, h, T, d_v))
        expect(torch.allclose(again[..., :p, :].double(), got[..., :p, :].double(), atol=tol),
               f"{what}: outputs before position {p} changed when the keys and values from {p} on changed: "
               "a query reads the future; read the state of the earlier chunks before adding the chunk's "
               "own keys to it, and inside the chunk keep s <= t only")
        first = min(C, T)
        expect(not torch.allclose(got[..., :first, :].double(), expected[..., :first, :], rtol=1e-5, atol=tol),
               f"{what}: the first chunk is right but later ones are not: between chunks, the state "
               "decays by gamma**C over a chunk of C tokens, key s of the chunk enters it with "
               "gamma**(C - 1 - s), and query r of the next chunk reads it with gamma**(r + 1)")
        expect(False, f"{what}: differs from the recurrence S_t = gamma S_(t-1) + k_t v_t^T, o_t = S_t^T q_t "
                      f"by {(got.double() - expected).abs().max().item():.3g}")


# ---------------------------------------------------------------- 18.2
#: 18.2 asks for the gather and the softmax: attnlib's top-k attention does both.
_OWN_TOPK = Refuse("gather the chosen keys yourself, not with attnlib's top-k attention",
                   topk_attention, topk_mask, TopKAttention)


def _sparse_step(q, K, V, index_scores, top_k):
    """Written with a boolean mask and a softmax over the chosen keys (float64)."""
    n = min(top_k, K.shape[-2])
    keep = torch.zeros_like(index_scores, dtype=torch.bool).scatter(-1, index_scores.topk(n, -1).indices, True)
    s = (K @ q[..., None]).squeeze(-1) * q.shape[-1] ** -0.5  # (B, h, T)
    w = s.masked_fill(~keep[:, None, :], float("-inf")).softmax(-1)
    return (w[..., None] * V).sum(-2)


def _diagnose_weights(sparse_decode_step, top_k: int, g: torch.Generator) -> None:
    """Read the weights an answer uses (values = the identity, so the output is the weights) and name
    what is off: how many keys, which keys, their sum, the scale of the scores."""
    B, h, T = 2, 3, 12
    q = torch.randn(B, h, T, generator=g, dtype=torch.float64)
    K = torch.randn(B, h, T, T, generator=g, dtype=torch.float64)
    V = torch.eye(T, dtype=torch.float64).expand(B, h, T, T).clone()  # value j = e_j
    index_scores = torch.randn(B, T, generator=g, dtype=torch.float64)
    case = f"B={B}, h={h}, T={T}, d={T}, top_k={top_k}, values = one-hot vectors (your output = your weights)"
    w = run(sparse_decode_step, q, K, V, index_scores, top_k, what=case, refuse=_OWN_TOPK)
    w = expect_tensor(w, case, shape=(B, h, T)).double()  # (B, h, T): the weight of each key
    n = min(top_k, T)
    used = w.abs() > 1e-12
    expect(bool((used.sum(-1) == n).all()),
           f"{case}: you give weight to {sorted(set(used.sum(-1).flatten().tolist()))} keys per head; attend to "
           f"exactly top_k = {n} (all T when top_k >= T)")
    chosen = torch.zeros(B, T, dtype=torch.bool).scatter(-1, index_scores.topk(n, -1).indices, True)
    expect(bool((used == chosen[:, None, :]).all()),
           f"{case}: the keys with weight are not the top_k of highest index_scores of each sequence "
           "(the same keys in every head of that sequence)")
    expect(torch.allclose(w.sum(-1), torch.ones(B, h, dtype=torch.float64), atol=1e-8),
           f"{case}: each head's weights sum to {w.sum(-1).flatten()[0].item():.4g}, not 1: softmax over the "
           "chosen keys of that head")
    s = (K @ q[..., None]).squeeze(-1)  # q·k per key
    logw, ss = w.clamp_min(1e-300).log()[used].view(B, h, n), s[used].view(B, h, n)
    if n > 1:
        dl, ds = logw - logw.mean(-1, keepdim=True), ss - ss.mean(-1, keepdim=True)
        slope = ((dl * ds).sum() / (ds * ds).sum()).item()
        expect(abs(slope - T**-0.5) < 1e-6,
               f"{case}: your weights are softmax({slope:.3g} x q·k), not softmax(q·k / sqrt(d)) with "
               f"1/sqrt(d) = {T**-0.5:.3g}")


@exercise("18.2")
def check_sparse_decode_step(sparse_decode_step) -> None:
    """Check ``sparse_decode_step(q (B, h, d), K, V (B, h, T, d), index_scores (B, T), top_k) -> (B, h, d)``."""
    g = case_rng()
    cases = [(2, 3, 10, 8, 4), (1, 2, 7, 4, 7), (2, 2, 5, 4, 9), (3, 4, 33, 16, 6), (1, 1, 6, 4, 1)]
    cases += [(randint(g, 1, 3), randint(g, 1, 4), randint(g, 2, 40), randint(g, 2, 16), randint(g, 1, 12))
              for _ in range(3)]
    for B, h, T, d, top_k in cases:
        q = torch.randn(B, h, d, generator=g, dtype=torch.float64)
        K, V = (torch.randn(B, h, T, d, generator=g, dtype=torch.float64) for _ in range(2))
        index_scores = torch.randn(B, T, generator=g, dtype=torch.float64)
        what = f"sparse_decode_step(q, K, V, index_scores, top_k={top_k}) with B={B}, h={h}, T={T}, d={d}"
        try:
            got = run(sparse_decode_step, q, K, V, index_scores, top_k, what=what, refuse=_OWN_TOPK)
        except Wrong as e:
            if top_k > T and "your code raised RuntimeError" in str(e):
                raise Wrong(f"{e}. top_k={top_k} exceeds the T={T} cached keys: attend to all of them then, "
                            "min(top_k, T)") from None
            raise
        if got is None:
            raise NotSolved("return the attention output (B, h, d), not None")
        expect_tensor(got, what, shape=(B, h, d))
        expect(not got.isnan().any(),
               f"{what}: your output holds NaN: a softmax ran over a row whose entries are all -inf (the "
               "wrong dimension?); take the softmax over the chosen keys of each head, the last dimension")
        expected = _sparse_step(q, K, V, index_scores, top_k)
        if torch.allclose(got.double(), expected, rtol=1e-7, atol=1e-9):
            continue
        per_head = (K @ q[..., None]).squeeze(-1)  # (B, h, T)
        n = min(top_k, T)
        keep = torch.zeros_like(per_head, dtype=torch.bool).scatter(-1, per_head.topk(n, -1).indices, True)
        w = (per_head * d**-0.5).masked_fill(~keep, float("-inf")).softmax(-1)
        expect(not (torch.allclose(got.double(), _sparse_step(q, K, V, per_head.sum(1), top_k), atol=1e-8)
                    or torch.allclose(got.double(), (w[..., None] * V).sum(-2), atol=1e-8)),
               f"{what}: the keys are chosen by index_scores (the indexer), not by q·k")
        dense = (per_head * d**-0.5).softmax(-1)
        kept = torch.zeros(B, T, dtype=torch.bool).scatter(-1, index_scores.topk(n, -1).indices, True)[:, None, :]
        expect(not torch.allclose(got.double(), ((dense * kept)[..., None] * V).sum(-2), atol=1e-8),
               f"{what}: you zeroed the other keys after a softmax over all T keys; the weights must sum to 1 "
               "over the chosen keys (softmax over the chosen keys only)")
        expect(not torch.allclose(got.double(), _sparse_step(q * d**0.5, K, V, index_scores, top_k), atol=1e-8),
               f"{what}: scale the scores q·k by 1/sqrt(d) before the softmax")
        _diagnose_weights(sparse_decode_step, top_k, g)
        expect(False, f"{what}: differs from softmax attention over the top_k keys of highest index score "
                      f"by {(got.double() - expected).abs().max().item():.3g}")


# ---------------------------------------------------------------- 18.3
_BREAK_EVEN_CASES = [  # (n_heads, head_dim, n_kv_heads, kv_head_dim)
    (4, 16, 4, 16),
    (32, 128, 2, 256),  # Qwen3-Next-80B-A3B: DeltaNet 32 value heads of 128; attention 2 KV heads of 256
    (8, 64, 8, 64),
    (16, 128, 8, 128),
    (12, 64, 1, 64),
    (3, 7, 2, 5),
]


@exercise("18.3")
def check_break_even_length(break_even_length) -> None:
    """Check ``break_even_length(n_heads, head_dim, n_kv_heads, kv_head_dim) -> int`` exactly."""
    g = case_rng()
    cases = _BREAK_EVEN_CASES + [(randint(g, 1, 64), randint(g, 3, 256), randint(g, 1, 16), randint(g, 3, 256))
                                 for _ in range(4)]
    for n_heads, head_dim, n_kv, kv_dim in cases:
        what = f"break_even_length(n_heads={n_heads}, head_dim={head_dim}, n_kv_heads={n_kv}, kv_head_dim={kv_dim})"
        got = expect_int(run(break_even_length, n_heads, head_dim, n_kv, kv_dim, what=what), what)
        state, per_token = n_heads * head_dim**2, 2 * n_kv * kv_dim
        expected = next(T for T in range(state // per_token, state // per_token + 3) if per_token * T > state)
        case = f"{what} = {got}, expected {expected}"
        if got == expected:
            continue
        expect(got != state // (n_kv * kv_dim) + 1,
               f"{case}: a KV cache keeps a key AND a value per head: 2 x n_kv_heads x kv_head_dim per token")
        expect(got != state // (2 * n_heads * kv_dim) + 1,
               f"{case}: the cache holds n_kv_heads={n_kv} heads (shared by the query heads), not n_heads")
        expect(got != n_heads * head_dim // (2 * n_kv * kv_dim) + 1,
               f"{case}: the state is head_dim x head_dim per head (d_k x d_v), not head_dim")
        expect(per_token * got > state,
               f"{case}: at T={got} the cache ({per_token * got} numbers) is not larger than the state ({state}) yet")
        expect(per_token * (got - 1) <= state,
               f"{case}: at T={got - 1} the cache ({per_token * (got - 1)}) already exceeds the state ({state}): "
               "the first T, not a later one")
        expect(False, f"{case}: the smallest T with 2 x n_kv_heads x kv_head_dim x T > n_heads x head_dim^2")
