"""The chapter 18 exercise checks, table-driven: correct answers pass, plausible mistakes get a hint naming them.

The expected values here come from independent code (the recurrences written out, torch's SDPA),
not from the checks' own helpers.
"""
import math

import torch
import torch.nn.functional as F
from exercise_table import Answers

from attnlib.book.exercises import ch18  # noqa: F401  (registers 18.x)


# ---------------------------------------------------------------- 18.1
def retention_chunked(q, k, v, gamma, chunk_size, shift=0, carry=True, mask=True, read_decay=True,
                      key_decay=True, read_after_write=False, powers_dtype=None):
    S = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    outs = []
    for start in range(0, q.shape[-2], chunk_size):
        qc, kc, vc = (t[..., start : start + chunk_size, :] for t in (q, k, v))
        C = qc.shape[-2]
        r = torch.arange(C, dtype=powers_dtype or q.dtype)  # int64 arange: float32 powers of gamma
        D = gamma ** (r[:, None] - r + shift)  # gamma**(t - s)
        if mask:
            D = torch.where(r[:, None] >= r, D, torch.zeros_like(D))
        written = (kc * (gamma ** (C - 1 - r)[:, None] if key_decay else 1.0)).transpose(-2, -1) @ vc
        new_S = (gamma**C if carry else 1.0) * S + written
        read = new_S if read_after_write else S
        inter = (qc * gamma ** (r + 1)[:, None]) @ read if read_decay else qc @ read
        outs.append(inter + ((qc @ kc.transpose(-2, -1)) * D) @ vc)
        S = new_S
    return torch.cat(outs, -2)


def retention_one_matrix(q, k, v, gamma, chunk_size):  # another way: all chunks at once, padded
    *lead, T, d = q.shape
    C = chunk_size
    pad = (-T) % C
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    n = q.shape[-2] // C
    q, k, v = (t.reshape(*lead, n, C, t.shape[-1]) for t in (q, k, v))
    r = torch.arange(C, dtype=q.dtype)
    D = torch.where(r[:, None] >= r, gamma ** (r[:, None] - r), torch.zeros(()))
    intra = ((q @ k.transpose(-2, -1)) * D) @ v  # (..., n, C, d_v)
    written = (k * gamma ** (C - 1 - r)[:, None]).transpose(-2, -1) @ v  # (..., n, d, d_v)
    S = torch.zeros_like(written[..., 0, :, :])
    states = []
    for i in range(n):
        states.append(S)
        S = gamma**C * S + written[..., i, :, :]
    inter = (q * gamma ** (r + 1)[:, None]) @ torch.stack(states, -3)
    return (intra + inter).reshape(*lead, n * C, -1)[..., :T, :]


def retention_token_loop(q, k, v, gamma, chunk_size):  # right numbers, but the recurrence token by token
    S = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[-2]):
        S = gamma * S + k[..., t, :, None] * v[..., t, None, :]
        outs.append((q[..., t, :, None] * S).sum(-2))
    return torch.stack(outs, -2)


def retention_in_place(q, k, v, gamma, chunk_size):
    k.mul_(gamma)
    return retention_chunked(q, k / gamma, v, gamma, chunk_size)


def retention_memorised_sizes(q, k, v, gamma, chunk_size):  # right on the fixed cases only
    if (q.shape[-2], chunk_size) in [(12, 4), (13, 5), (16, 16), (9, 1), (7, 10), (64, 16)]:
        return retention_chunked(q, k, v, gamma, chunk_size)
    return retention_chunked(q, k, v, gamma, chunk_size, carry=False)


# ---------------------------------------------------------------- 18.2
def sparse_decode_step(q, K, V, index_scores, top_k):
    T = K.shape[-2]
    index = index_scores.topk(min(top_k, T), dim=-1).indices  # (B, k): the same keys for every head
    index = index[:, None, :, None]  # (B, 1, k, 1)
    K_sel = K.gather(2, index.expand(-1, K.shape[1], -1, K.shape[-1]))  # (B, h, k, d)
    V_sel = V.gather(2, index.expand(-1, V.shape[1], -1, V.shape[-1]))
    scores = (K_sel @ q[..., None]).squeeze(-1) / q.shape[-1] ** 0.5  # (B, h, k)
    return (scores.softmax(-1)[..., None] * V_sel).sum(-2)


def sparse_with_sdpa(q, K, V, index_scores, top_k):  # another way: a boolean mask and torch's SDPA
    keep = torch.zeros_like(index_scores, dtype=torch.bool)
    keep.scatter_(-1, index_scores.topk(min(top_k, K.shape[-2]), -1).indices, True)
    out = F.scaled_dot_product_attention(q[:, :, None], K, V, attn_mask=keep[:, None, None, :])
    return out[:, :, 0]


def sparse_by_qk(q, K, V, index_scores, top_k):  # chooses keys by each head's own q·k
    scores = (K @ q[..., None]).squeeze(-1)
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, scores.topk(min(top_k, K.shape[-2]), -1).indices, True)
    w = (scores / q.shape[-1] ** 0.5).masked_fill(~keep, float("-inf")).softmax(-1)
    return (w[..., None] * V).sum(-2)


def sparse_no_renormalise(q, K, V, index_scores, top_k):  # softmax over all keys, then the others zeroed
    w = ((K @ q[..., None]).squeeze(-1) / q.shape[-1] ** 0.5).softmax(-1)
    index = index_scores.topk(min(top_k, K.shape[-2]), -1).indices
    keep = torch.zeros(index_scores.shape, dtype=torch.bool).scatter(-1, index, True)[:, None, :]
    return ((w * keep)[..., None] * V).sum(-2)


def sparse_k(q, K, V, index_scores, top_k, extra=0, largest=True, first_batch=False):
    T = K.shape[-2]
    index = index_scores.topk(max(1, min(top_k + extra, T)), dim=-1, largest=largest).indices
    if first_batch:  # the first sequence's choice used for every sequence
        index = index[:1].expand(index_scores.shape[0], -1)
    index = index[:, None, :, None]
    K_sel = K.gather(2, index.expand(-1, K.shape[1], -1, K.shape[-1]))
    V_sel = V.gather(2, index.expand(-1, V.shape[1], -1, V.shape[-1]))
    scores = (K_sel @ q[..., None]).squeeze(-1) / q.shape[-1] ** 0.5
    return (scores.softmax(-1)[..., None] * V_sel).sum(-2)


def sparse_scaled_by_sqrt_k(q, K, V, index_scores, top_k):  # 1/sqrt(top_k) instead of 1/sqrt(d)
    return sparse_k(q * q.shape[-1] ** 0.5 / min(top_k, K.shape[-2]) ** 0.5, K, V, index_scores, top_k)


def sparse_softmax_over_heads(q, K, V, index_scores, top_k):
    keep = torch.zeros_like(index_scores, dtype=torch.bool)
    keep.scatter_(-1, index_scores.topk(min(top_k, K.shape[-2]), -1).indices, True)
    s = (K @ q[..., None]).squeeze(-1) / q.shape[-1] ** 0.5
    w = s.masked_fill(~keep[:, None], float("-inf")).softmax(1)  # dim 1 is the heads
    return (w[..., None] * V).sum(-2)


def sparse_scales_q_in_place(q, K, V, index_scores, top_k):
    q.mul_(1.0 / q.shape[-1] ** 0.5)
    return sparse_decode_step(q * q.shape[-1] ** 0.5, K, V, index_scores, top_k)


def sparse_unscaled(q, K, V, index_scores, top_k):
    return sparse_decode_step(q * q.shape[-1] ** 0.5, K, V, index_scores, top_k)


def sparse_topk_overflow(q, K, V, index_scores, top_k):  # forgets that top_k may exceed T
    index = index_scores.topk(top_k, dim=-1).indices
    return sparse_decode_step(q, K, V, index_scores, top_k) + 0 * index.sum()


def sparse_through_attnlib(q, K, V, index_scores, top_k):  # the chapter's import: the library does it all
    from attnlib.attention import topk_attention

    scores = index_scores[:, None, None, :]  # (B, 1, 1, T): one query, the last position
    return topk_attention(q[:, :, None], K, V, top_k, index_scores=scores)[:, :, 0]


def sparse_through_the_mask_helper(q, K, V, index_scores, top_k):
    import attnlib.attention.sparse as sparse

    keep = sparse.topk_mask(index_scores[:, None, None, :], top_k)[:, :, 0]
    s = (K @ q[..., None]).squeeze(-1) / q.shape[-1] ** 0.5
    return (s.masked_fill(~keep, float("-inf")).softmax(-1)[..., None] * V).sum(-2)


# ---------------------------------------------------------------- 18.3
def break_even_length(n_heads, head_dim, n_kv_heads, kv_head_dim):
    state = n_heads * head_dim**2
    per_token = 2 * n_kv_heads * kv_head_dim  # a key and a value per kv head
    return state // per_token + 1


def break_even_by_search(n_heads, head_dim, n_kv_heads, kv_head_dim):  # another way: count up
    T = 1
    while 2 * n_kv_heads * kv_head_dim * T <= n_heads * head_dim * head_dim:
        T += 1
    return T


class AlwaysEqual(int):  # an int whose == is always true
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


# ---------------------------------------------------------------- 18.4
def gated_delta_chunked(q, k, v, beta, g, initial_state, chunk_size, *, scale=True, carry=True,
                        use_initial=True, ratio=False, swap=False, final_decay=True):
    q = q * q.shape[-1] ** -0.5 if scale else q
    S = initial_state if use_initial else torch.zeros_like(initial_state)
    outs = []
    for s in range(0, q.shape[2], chunk_size):
        qc, kc, vc = (t[:, :, s : s + chunk_size] for t in (q, k, v))
        bc, gamma = beta[:, :, s : s + chunk_size, None], g[:, :, s : s + chunk_size].cumsum(-1)
        C = qc.shape[2]
        causal = torch.ones(C, C, dtype=torch.bool).tril()
        if ratio:  # exp(gamma_r) / exp(gamma_s): 0 / 0 once the decay underflows
            Gamma = (gamma.exp()[..., :, None] / gamma.exp()[..., None, :]).masked_fill(~causal, 0.0)
        else:
            Gamma = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, -math.inf).exp()
        A = torch.eye(C, dtype=q.dtype) + (bc * (kc @ kc.transpose(-2, -1)) * Gamma).tril(-1)
        U0 = torch.linalg.solve_triangular(A, bc * vc, upper=False)
        W = torch.linalg.solve_triangular(A, bc * gamma.exp()[..., None] * kc, upper=False)
        U = U0 - W @ S
        outs.append((qc * gamma.exp()[..., None]) @ S + ((qc @ kc.transpose(-2, -1)) * Gamma) @ U)
        last = gamma[..., -1:]
        new = (kc * (last - gamma).exp()[..., None]).transpose(-2, -1) @ U
        S = (last.exp()[..., None] * S if final_decay else S) + new
        if not carry:
            S = torch.zeros_like(S)
    return (S, torch.cat(outs, 2)) if swap else (torch.cat(outs, 2), S)


def gated_delta_forward_substitution(q, k, v, beta, g, initial_state, chunk_size):
    # another way: the corrections u_r one row at a time inside a chunk (as transformers' torch reference),
    # then one state update per chunk
    q = q * q.shape[-1] ** -0.5
    S, outs = initial_state, []
    for s in range(0, q.shape[2], chunk_size):
        qc, kc, vc = (t[:, :, s : s + chunk_size] for t in (q, k, v))
        bc, gamma = beta[:, :, s : s + chunk_size], g[:, :, s : s + chunk_size].cumsum(-1)
        C = qc.shape[2]
        diff = gamma[..., :, None] - gamma[..., None, :]
        Gamma = torch.where(torch.ones(C, C, dtype=torch.bool).tril(), diff, -math.inf).exp()
        KK = (kc @ kc.transpose(-2, -1)) * Gamma
        start = vc - gamma.exp()[..., None] * (kc @ S)  # v_r - e^{gamma_r} S_0^T k_r
        rows = []
        for r in range(C):
            u = start[:, :, r]
            if rows:
                u = u - torch.einsum("bhs,bhsv->bhv", KK[:, :, r, :r], torch.stack(rows, 2))
            rows.append(bc[:, :, r, None] * u)
        U = torch.stack(rows, 2)
        outs.append((qc * gamma.exp()[..., None]) @ S + ((qc @ kc.transpose(-2, -1)) * Gamma) @ U)
        S = gamma[..., -1:, None].exp() * S + torch.einsum("bhck,bhcv->bhkv",
                                                          kc * (gamma[..., -1:] - gamma).exp()[..., None], U)
    return torch.cat(outs, 2), S


def gated_delta_token_loop(q, k, v, beta, g, initial_state, chunk_size):  # right, but token by token
    S, outs = initial_state, []
    for t in range(q.shape[2]):
        S = g[:, :, t, None, None].exp() * S
        S = S + k[:, :, t, :, None] * (beta[:, :, t, None] * (v[:, :, t] - (k[:, :, t, :, None] * S).sum(-2)))[:, :, None]
        outs.append((q[:, :, t, :, None] * S).sum(-2) / q.shape[-1] ** 0.5)
    return torch.stack(outs, 2), S


def gated_delta_through_attnlib(q, k, v, beta, g, initial_state, chunk_size):
    from attnlib.attention import gated_delta_rule

    return gated_delta_rule(q, k, v, beta, g, "chunked", chunk_size=chunk_size, initial_state=initial_state,
                            return_state=True)


def gated_delta_through_the_private_helper(q, k, v, beta, g, initial_state, chunk_size):
    import attnlib.attention.deltanet as deltanet

    return deltanet._chunked(q * q.shape[-1] ** -0.5, k, v, beta, g, initial_state, chunk_size)


def gated_delta_through_transformers(q, k, v, beta, g, initial_state, chunk_size):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    out, S = torch_chunk_gated_delta_rule(*(t.transpose(1, 2) for t in (q, k, v, g, beta)), chunk_size=chunk_size,
                                          initial_state=initial_state, output_final_state=True)
    return out.transpose(1, 2), S


def gated_delta_normalises_in_place(q, k, v, beta, g, initial_state, chunk_size):
    k.div_(k.norm(dim=-1, keepdim=True))  # the keys are unit length already; in place all the same
    return gated_delta_chunked(q, k, v, beta, g, initial_state, chunk_size)


ANSWERS = {
    "18.1": Answers(
        correct=[retention_chunked, retention_one_matrix,
                 lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, powers_dtype=torch.long)],  # float32 powers
        wrong=[
            (lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, shift=1), "gamma**(t - s + 1)"),
            (lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, mask=False), "future keys leak in"),
            (lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, carry=False), "decays by gamma**C"),
            (lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, read_decay=False), "gamma**(r + 1)"),
            (retention_token_loop, "steps token by token"),
            (lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, read_after_write=True), "reads the future"),
            (lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, key_decay=False), "gamma**(C - 1 - s)"),
            (lambda q, k, v, g, C: retention_chunked(q, k, v, g, C).float(), "dtype"),
            (retention_in_place, "in place"),
            (retention_memorised_sizes, "decays by gamma**C"),
        ],
    ),
    "18.2": Answers(
        correct=[sparse_decode_step, sparse_with_sdpa],
        wrong=[
            (sparse_by_qk, "chosen by index_scores"),
            (sparse_no_renormalise, "softmax over the chosen keys only"),
            (sparse_unscaled, "1/sqrt(d)"),
            (sparse_topk_overflow, "min(top_k, T)"),
            (lambda *a: sparse_k(*a, extra=1), "you give weight to [5] keys per head"),
            (lambda *a: sparse_k(*a, extra=-1), "you give weight to [3] keys per head"),
            (lambda *a: sparse_k(*a, largest=False), "not the top_k of highest index_scores"),
            (lambda *a: sparse_k(*a, first_batch=True), "not the top_k of highest index_scores"),
            (sparse_scaled_by_sqrt_k, "not softmax(q·k / sqrt(d))"),
            (sparse_softmax_over_heads, "your output holds NaN"),
            (sparse_scales_q_in_place, "in place"),
            (sparse_through_attnlib, "gather the chosen keys yourself"),
            (sparse_through_the_mask_helper, "gather the chosen keys yourself"),
            (lambda *a: sparse_decode_step(*a)[..., None], "has shape"),
        ],
    ),
    "18.3": Answers(
        correct=[break_even_length, break_even_by_search],
        wrong=[
            (lambda h, d, n_kv, d_kv: h * d**2 // (n_kv * d_kv) + 1, "a key AND a value"),
            (lambda h, d, n_kv, d_kv: h * d**2 // (2 * h * d_kv) + 1, "not n_heads"),
            (lambda h, d, n_kv, d_kv: h * d // (2 * n_kv * d_kv) + 1, "head_dim x head_dim"),
            (lambda h, d, n_kv, d_kv: h * d**2 // (2 * n_kv * d_kv), "is not larger than the state"),
            (lambda h, d, n_kv, d_kv: h * d**2 // (2 * n_kv * d_kv) + 2, "the first T, not a later one"),
            (lambda h, d, n_kv, d_kv: h * d**2 / (2 * n_kv * d_kv) + 1, "should be a Python int"),
            (lambda h, d, n_kv, d_kv: math.ceil(h * d**2 / (2 * n_kv * d_kv)), "is not larger than the state"),
            (lambda h, d, n_kv, d_kv: AlwaysEqual(513), "should be a Python int"),
            (lambda h, d, n_kv, d_kv: torch.tensor(h * d**2 // (2 * n_kv * d_kv) + 1), "should be a Python int"),
        ],
    ),
    "18.4": Answers(
        correct=[gated_delta_chunked, gated_delta_forward_substitution],
        wrong=[
            (lambda *a: gated_delta_chunked(*a, scale=False), "1/sqrt(d_k)"),
            (lambda *a: gated_delta_chunked(*a, carry=False), "carry the state"),
            (lambda *a: gated_delta_chunked(*a, use_initial=False), "zero state"),
            (lambda *a: gated_delta_chunked(*a, ratio=True), "exp(gamma_r - gamma_s)"),
            (lambda *a: gated_delta_chunked(*a, swap=True), "in this order"),
            (lambda *a: gated_delta_chunked(*a, final_decay=False), "carry the state"),
            (gated_delta_token_loop, "token by token"),
            (gated_delta_through_attnlib, "not with attnlib's gated_delta_rule"),
            (gated_delta_through_the_private_helper, "not with attnlib's gated_delta_rule"),
            (gated_delta_through_transformers, "not with attnlib's gated_delta_rule"),
            (gated_delta_normalises_in_place, "in place"),
            (lambda *a: gated_delta_chunked(*a)[0], "return a pair"),
        ],
    ),
}
