"""Exercise checks for chapter 18 (beyond softmax).

* 18.1 ``check_retention_chunked``: ``retention_chunked(q, k, v, gamma, chunk_size)``, the chunked
  form of linear attention with a constant decay (RetNet's retention, Sun et al. 2023):
  ``S_t = γ S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t``, checked against the token-by-token recurrence
  for several lengths, chunk sizes and decays (to float32 rounding); a wrong answer is probed for
  reading the future; an answer that loops over tokens is refused by counting its tensor operations.
* 18.2 ``check_sparse_decode_step``: ``sparse_decode_step(q, K, V, index_scores, top_k)``, one
  decoding step of top-k attention whose keys are chosen by an indexer's scores (as DeepSeek's
  DSA), checked against dense attention over the chosen keys; a wrong answer's weights are read
  back (one-hot values) to say how many and which keys it used, their sum and their scale.
* 18.3 ``check_break_even_length``: ``break_even_length(n_heads, head_dim, n_kv_heads, kv_head_dim)``,
  the shortest sequence whose KV cache (one layer, K and V of ``n_kv_heads`` heads) holds more
  numbers than a gated DeltaNet state (``n_heads · head_dim²``); checked exactly.

Random inputs come from a local ``torch.Generator``.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnlib.book.exercises._core import NotSolved, Wrong, exercise, expect

__all__ = ["check_break_even_length", "check_retention_chunked", "check_sparse_decode_step"]


# ---------------------------------------------------------------- 18.1
def _retention(q, k, v, gamma):
    """The recurrence itself, one token at a time (float64)."""
    S = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[-2]):
        S = gamma * S + k[..., t, :, None] * v[..., t, None, :]
        outs.append((q[..., t, :, None] * S).sum(-2))
    return torch.stack(outs, -2)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


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


@exercise("18.1")
def check_retention_chunked(retention_chunked) -> None:
    """Check ``retention_chunked(q, k, v, gamma, chunk_size) -> (..., T, d_v)`` against the recurrence."""
    g = torch.Generator().manual_seed(18)
    cases = [(12, 4, 0.9), (13, 5, 0.7), (16, 16, 0.95), (9, 1, 0.5), (7, 10, 0.8), (64, 16, 0.97)]
    for T, C, gamma in cases:
        q, k, v = (torch.randn(2, 3, T, d, generator=g, dtype=torch.float64) for d in (4, 4, 5))
        inputs = [t.clone() for t in (q, k, v)]
        counter = _CountOps()
        with counter:
            got = retention_chunked(q, k, v, gamma, C)
        if got is None:
            raise NotSolved("return the output (..., T, d_v), not None")
        case = f"T={T}, chunk_size={C}, gamma={gamma}"
        expect(all(torch.equal(a, b) for a, b in zip(inputs, (q, k, v))), f"{case}: your code changed q, k or v in place")
        expect(isinstance(got, torch.Tensor) and tuple(got.shape) == (2, 3, T, 5),
               f"{case}: return a tensor of shape (..., T, d_v) = (2, 3, {T}, 5); got {getattr(got, 'shape', got)}")
        expected = _retention(q, k, v, gamma)
        tol = 1e-6 * expected.abs().max().item()  # float32 powers of gamma are fine: the algebra is checked
        if torch.allclose(got.double(), expected, rtol=1e-5, atol=tol):
            chunks = -(-T // C)
            expect(T < 64 or counter.count <= 40 * chunks + 60,
                   f"{case}: {counter.count} tensor operations for {chunks} chunks: your code steps token by token; "
                   "compute each chunk with matrix products and carry the state between chunks only")
            continue
        expect(not torch.allclose(got.double(), _retention_slip(q, k, v, gamma, C, shift=1), atol=1e-8),
               f"{case}: the weight of key s for query t is gamma**(t - s): a token's own key is not decayed "
               "(you used gamma**(t - s + 1))")
        expect(not torch.allclose(got.double(), _retention_slip(q, k, v, gamma, C, mask=False), atol=1e-8),
               f"{case}: future keys leak in: inside a chunk mask the decay matrix to s <= t (gamma**(t - s) "
               "for s > t is not zero)")
        p = T // 2  # change the keys and values from position p on: the outputs before p must not move
        k2, v2 = k.clone(), v.clone()
        k2[..., p:, :], v2[..., p:, :] = -k2[..., p:, :], 2 * v2[..., p:, :]
        again = retention_chunked(q, k2, v2, gamma, C)
        expect(torch.allclose(again[..., :p, :].double(), got[..., :p, :].double(), atol=tol),
               f"{case}: outputs before position {p} changed when the keys and values from {p} on changed: "
               "a query reads the future; read the state of the earlier chunks before adding the chunk's "
               "own keys to it, and inside the chunk keep s <= t only")
        first = min(C, T)
        expect(not torch.allclose(got[..., :first, :].double(), expected[..., :first, :], rtol=1e-5, atol=tol),
               f"{case}: the first chunk is right but later ones are not: between chunks, the state "
               "decays by gamma**C over a chunk of C tokens, key s of the chunk enters it with "
               "gamma**(C - 1 - s), and query r of the next chunk reads it with gamma**(r + 1)")
        expect(False, f"{case}: differs from the recurrence S_t = gamma S_(t-1) + k_t v_t^T, o_t = S_t^T q_t "
                      f"by {(got.double() - expected).abs().max().item():.3g}")


# ---------------------------------------------------------------- 18.2
def _sparse_step(q, K, V, index_scores, top_k):
    T = K.shape[-2]
    index = index_scores.topk(min(top_k, T), dim=-1).indices  # (B, k)
    gather = index[:, None, :, None]
    K_sel = K.gather(2, gather.expand(-1, K.shape[1], -1, K.shape[-1]))
    V_sel = V.gather(2, gather.expand(-1, V.shape[1], -1, V.shape[-1]))
    w = ((K_sel @ q[..., None]).squeeze(-1) * q.shape[-1] ** -0.5).softmax(-1)  # (B, h, k)
    return (w[..., None] * V_sel).sum(-2)


def _diagnose_weights(sparse_decode_step, top_k: int) -> None:
    """Read the weights an answer uses (values = the identity, so the output is the weights) and name
    what is off: how many keys, which keys, their sum, the scale of the scores."""
    g = torch.Generator().manual_seed(1821)
    B, h, T = 2, 3, 12
    q = torch.randn(B, h, T, generator=g, dtype=torch.float64)
    K = torch.randn(B, h, T, T, generator=g, dtype=torch.float64)
    V = torch.eye(T, dtype=torch.float64).expand(B, h, T, T).clone()  # value j = e_j
    index_scores = torch.randn(B, T, generator=g, dtype=torch.float64)
    w = sparse_decode_step(q, K, V, index_scores, top_k).double()  # (B, h, T): the weight of each key
    n = min(top_k, T)
    used = w.abs() > 1e-12
    case = f"B={B}, h={h}, T={T}, d={T}, top_k={top_k}, values = one-hot vectors (your output = your weights)"
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
    g = torch.Generator().manual_seed(182)
    for B, h, T, d, top_k in [(2, 3, 10, 8, 4), (1, 2, 7, 4, 7), (2, 2, 5, 4, 9), (3, 4, 33, 16, 6), (1, 1, 6, 4, 1)]:
        q = torch.randn(B, h, d, generator=g, dtype=torch.float64)
        K, V = (torch.randn(B, h, T, d, generator=g, dtype=torch.float64) for _ in range(2))
        index_scores = torch.randn(B, T, generator=g, dtype=torch.float64)
        case = f"B={B}, h={h}, T={T}, d={d}, top_k={top_k}"
        inputs = [t.clone() for t in (q, K, V, index_scores)]
        try:
            got = sparse_decode_step(q, K, V, index_scores, top_k)
        except RuntimeError as e:
            if top_k > T:
                raise Wrong(f"{case}: top_k exceeds the T={T} cached keys ({e}); attend to all of them then, "
                            "min(top_k, T)") from None
            raise
        if got is None:
            raise NotSolved("return the attention output (B, h, d), not None")
        expect(isinstance(got, torch.Tensor) and tuple(got.shape) == (B, h, d),
               f"{case}: return a tensor of shape (B, h, d) = {(B, h, d)}; got {getattr(got, 'shape', got)}")
        expect(all(torch.equal(a, b) for a, b in zip(inputs, (q, K, V, index_scores))),
               f"{case}: your code changed q, K, V or index_scores in place")
        expect(not got.isnan().any(),
               f"{case}: your output holds NaN: a softmax ran over a row whose entries are all -inf (the "
               "wrong dimension?); take the softmax over the chosen keys of each head, the last dimension")
        expected = _sparse_step(q, K, V, index_scores, top_k)
        if torch.allclose(got.double(), expected, atol=1e-8):
            continue
        own = _sparse_step(q, K, V, (K @ q[..., None]).squeeze(-1).sum(1), top_k)  # chosen by q·k summed over heads
        per_head = (K @ q[..., None]).squeeze(-1)
        keep = torch.zeros_like(per_head, dtype=torch.bool).scatter(-1, per_head.topk(min(top_k, T), -1).indices, True)
        w = (per_head * d**-0.5).masked_fill(~keep, float("-inf")).softmax(-1)
        expect(not (torch.allclose(got.double(), own, atol=1e-8)
                    or torch.allclose(got.double(), (w[..., None] * V).sum(-2), atol=1e-8)),
               f"{case}: the keys are chosen by index_scores (the indexer), not by q·k")
        dense = (((K @ q[..., None]).squeeze(-1)) * d**-0.5).softmax(-1)
        index = index_scores.topk(min(top_k, T), dim=-1).indices
        kept = torch.zeros(B, T, dtype=torch.bool).scatter(-1, index, True)[:, None, :]
        expect(not torch.allclose(got.double(), ((dense * kept)[..., None] * V).sum(-2), atol=1e-8),
               f"{case}: you zeroed the other keys after a softmax over all T keys; the weights must sum to 1 "
               "over the chosen keys (softmax over the chosen keys only)")
        unscaled = _sparse_step(q * d**0.5, K, V, index_scores, top_k)
        expect(not torch.allclose(got.double(), unscaled, atol=1e-8),
               f"{case}: scale the scores q·k by 1/sqrt(d) before the softmax")
        _diagnose_weights(sparse_decode_step, top_k)
        expect(False, f"{case}: differs from softmax attention over the top_k keys of highest index score "
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


def _break_even(n_heads, head_dim, n_kv_heads, kv_head_dim) -> int:
    return n_heads * head_dim**2 // (2 * n_kv_heads * kv_head_dim) + 1  # first T with 2 n_kv d T > h d²


@exercise("18.3")
def check_break_even_length(break_even_length) -> None:
    """Check ``break_even_length(n_heads, head_dim, n_kv_heads, kv_head_dim) -> int`` exactly."""
    for n_heads, head_dim, n_kv, kv_dim in _BREAK_EVEN_CASES:
        got = break_even_length(n_heads, head_dim, n_kv, kv_dim)
        if got is None:
            raise NotSolved("return the length T as an int, not None")
        expect(isinstance(got, int) and not isinstance(got, bool),
               f"return a Python int; got {type(got).__name__} (use // for integer division)")
        expected = _break_even(n_heads, head_dim, n_kv, kv_dim)
        case = (f"break_even_length(n_heads={n_heads}, head_dim={head_dim}, n_kv_heads={n_kv}, "
                f"kv_head_dim={kv_dim}) = {got}, expected {expected}")
        if got == expected:
            continue
        state, per_token = n_heads * head_dim**2, 2 * n_kv * kv_dim
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
