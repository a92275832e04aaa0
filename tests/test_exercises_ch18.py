"""The chapter 18 exercise checks: the solution is correct, plausible mistakes are wrong with a hint naming them."""
import pytest
import torch

from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, ch18, grade  # noqa: F401  (ch18 registers 18.x)


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


def retention_token_loop(q, k, v, gamma, chunk_size):  # right numbers, but the recurrence token by token
    S = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[-2]):
        S = gamma * S + k[..., t, :, None] * v[..., t, None, :]
        outs.append((q[..., t, :, None] * S).sum(-2))
    return torch.stack(outs, -2)


def retention_in_place(q, k, v, gamma, chunk_size):
    q.mul_(1.0)
    k.mul_(gamma)
    return retention_chunked(q, k / gamma, v, gamma, chunk_size)


# ---------------------------------------------------------------- 18.2
def sparse_decode_step(q, K, V, index_scores, top_k):
    T = K.shape[-2]
    index = index_scores.topk(min(top_k, T), dim=-1).indices  # (B, k): the same keys for every head
    index = index[:, None, :, None]  # (B, 1, k, 1)
    K_sel = K.gather(2, index.expand(-1, K.shape[1], -1, K.shape[-1]))  # (B, h, k, d)
    V_sel = V.gather(2, index.expand(-1, V.shape[1], -1, V.shape[-1]))
    scores = (K_sel @ q[..., None]).squeeze(-1) / q.shape[-1] ** 0.5  # (B, h, k)
    return (scores.softmax(-1)[..., None] * V_sel).sum(-2)


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


# ---------------------------------------------------------------- 18.3
def break_even_length(n_heads, head_dim, n_kv_heads, kv_head_dim):
    return n_heads * head_dim**2 // (2 * n_kv_heads * kv_head_dim) + 1


CORRECT_ANSWERS = [
    ("18.1", retention_chunked),
    ("18.1", lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, powers_dtype=torch.long)),  # float32 powers
    ("18.2", sparse_decode_step),
    ("18.3", break_even_length),
]


@pytest.mark.parametrize("exercise_id, answer", CORRECT_ANSWERS)
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("18.1", lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, shift=1), "gamma**(t - s + 1)"),
        ("18.1", lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, mask=False), "future keys leak in"),
        ("18.1", lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, carry=False), "decays by gamma**C"),
        ("18.1", lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, read_decay=False), "gamma**(r + 1)"),
        ("18.1", retention_token_loop, "steps token by token"),
        ("18.1", lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, read_after_write=True), "reads the future"),
        ("18.1", lambda q, k, v, g, C: retention_chunked(q, k, v, g, C, key_decay=False), "gamma**(C - 1 - s)"),
        ("18.1", retention_in_place, "changed q, k or v in place"),
        ("18.2", sparse_by_qk, "chosen by index_scores"),
        ("18.2", sparse_no_renormalise, "softmax over the chosen keys only"),
        ("18.2", sparse_unscaled, "1/sqrt(d)"),
        ("18.2", sparse_topk_overflow, "min(top_k, T)"),
        ("18.2", lambda *a: sparse_k(*a, extra=1), "you give weight to [5] keys per head"),
        ("18.2", lambda *a: sparse_k(*a, extra=-1), "you give weight to [3] keys per head"),
        ("18.2", lambda *a: sparse_k(*a, largest=False), "not the top_k of highest index_scores"),
        ("18.2", lambda *a: sparse_k(*a, first_batch=True), "not the top_k of highest index_scores"),
        ("18.2", sparse_scaled_by_sqrt_k, "not softmax(q·k / sqrt(d))"),
        ("18.2", sparse_softmax_over_heads, "your output holds NaN"),
        ("18.2", sparse_scales_q_in_place, "changed q, K, V or index_scores in place"),
        ("18.3", lambda h, d, n_kv, d_kv: h * d**2 // (n_kv * d_kv) + 1, "a key AND a value"),
        ("18.3", lambda h, d, n_kv, d_kv: h * d**2 // (2 * h * d_kv) + 1, "not n_heads"),
        ("18.3", lambda h, d, n_kv, d_kv: h * d // (2 * n_kv * d_kv) + 1, "head_dim x head_dim"),
        ("18.3", lambda h, d, n_kv, d_kv: h * d**2 // (2 * n_kv * d_kv), "is not larger than the state"),
        ("18.3", lambda h, d, n_kv, d_kv: h * d**2 / (2 * n_kv * d_kv) + 1, "return a Python int"),
    ],
)
def test_plausible_mistake_is_wrong(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


@pytest.mark.parametrize("exercise_id", ["18.1", "18.2", "18.3"])
def test_stub_is_not_solved(exercise_id):
    def stub(*args):
        raise NotImplementedError("write it")

    assert grade(exercise_id, stub).status == NOT_SOLVED
