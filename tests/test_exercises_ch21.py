"""The chapter 21 exercise checks, table-driven: correct answers pass, plausible mistakes get a hint naming them.

The checks' references are pinned here to independent code: attnlib's ``gated_delta_rule`` (a decay constant over
the channels) and transformers' Kimi Linear torch references (a decay per channel) for 21.1; a loop over each
query's sorted scores, attnlib's ``topk_mask`` and transformers' ``DeepseekV32Indexer`` for 21.2; the bytes of the
caches that transformers' Qwen3.5 fills (its conv and recurrent states and its KV cache, against the same model with
every layer full) for 21.3.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from exercise_table import Answers

from attnlib.attention import gated_delta_rule, topk_mask
from attnlib.book.exercises import ch21
from attnlib.book.exercises._ch21_indexer import _allowed, _probe, index_scores
from attnlib.book.exercises._ch21_kda import kda_loop


# ---------------------------------------------------------------- 21.1
def kda_chunk(q, k, v, beta, g, S0):  # the solution's way: the recurrence, token by token
    S, outs = S0.clone(), []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, :, None].exp()  # Diag(α_t) S: one decay per row (key channel)
        read = torch.einsum("bhk,bhkv->bhv", k[:, :, t], S)  # Sᵀ k_t
        delta = beta[:, :, t, None] * (v[:, :, t] - read)
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, dim=2), S


def kda_by_matrices(q, k, v, beta, g, S0):  # another way: (I - β k kᵀ) Diag(α) S + β k vᵀ with explicit matrices
    d_k = q.shape[-1]
    eye = torch.eye(d_k, dtype=q.dtype)
    S, outs = S0, []
    for t in range(q.shape[2]):
        k_t, b_t = k[:, :, t, :, None], beta[:, :, t, None, None]  # (B, H, d_k, 1), (B, H, 1, 1)
        erase = eye - b_t * (k_t @ k_t.transpose(-2, -1))
        S = erase @ torch.diag_embed(g[:, :, t].exp()) @ S + b_t * k_t @ v[:, :, t, None, :]
        outs.append((S.transpose(-2, -1) @ q[:, :, t, :, None])[..., 0])
    return torch.stack(outs, dim=2), S


def kda_chunked(q, k, v, beta, g, S0):  # another way: the whole chunk at once (the WY/UT form, per channel)
    C = q.shape[2]
    gamma = g.cumsum(2)  # (B, H, C, d_k): log decay from the chunk's start to r, per channel
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    decay = (gamma[:, :, :, None, :] - gamma[:, :, None, :, :]).masked_fill(~lower[..., None], -math.inf).exp()
    KK = torch.einsum("bhrc,bhsc,bhrsc->bhrs", k, k, decay)  # Σ_i k_r,i k_s,i e^{γ_r,i - γ_s,i}
    A = torch.eye(C, dtype=q.dtype) + beta[..., None] * KK.tril(-1)
    rhs = beta[..., None] * (v - (k * gamma.exp()) @ S0)
    U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # the corrections u_r
    QK = torch.einsum("bhrc,bhsc,bhrsc->bhrs", q, k, decay)
    o = (q * gamma.exp()) @ S0 + QK @ U
    last = gamma[:, :, -1:]  # (B, H, 1, d_k)
    S = last.transpose(-2, -1).exp() * S0 + (k * (last - gamma).exp()).transpose(-2, -1) @ U
    return o, S


def kda_with(q, k, v, beta, g, S0, **variant):
    o, S = kda_loop(q, k, v, beta, g, S0, **variant)
    return o.to(q.dtype), S.to(q.dtype)


def kda_through_gated_delta_rule(q, k, v, beta, g, S0):  # a scalar decay through attnlib's function (refused)
    return gated_delta_rule(q, k, v, beta, g.mean(-1), "recurrent", scale=1.0, initial_state=S0, return_state=True)


def kda_through_transformers(q, k, v, beta, g, S0):
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

    o, S = recurrent_kimi_delta_attention(*(t.transpose(1, 2) for t in (q * q.shape[-1] ** 0.5, k, v, g)),
                                          beta.transpose(1, 2), S0, True)
    return o.transpose(1, 2), S.to(q.dtype)


def _kda_inputs(seed, B=2, H=3, C=7, d_k=5, d_v=4, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, C, d_k, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, H, C, d_k, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, H, C, d_v, generator=gen, dtype=dtype)
    beta = torch.rand(B, H, C, generator=gen, dtype=dtype)
    g = -2 * torch.rand(B, H, C, d_k, generator=gen, dtype=dtype)
    S0 = torch.randn(B, H, d_k, d_v, generator=gen, dtype=dtype)
    return q, k, v, beta, g, S0


def test_the_kda_reference_is_gated_delta_rule_when_the_decay_is_one_per_head():
    """One decay for every channel: Diag(α) = α I, and the recurrence is chapter 18's gated delta rule."""
    q, k, v, beta, g, S0 = _kda_inputs(0)
    g = g[..., :1].expand_as(g)
    o, S = kda_loop(q, k, v, beta, g, S0)
    for mode in ("recurrent", "chunked"):
        want_o, want_S = gated_delta_rule(q, k, v, beta, g[..., 0], mode, chunk_size=3, scale=1.0, initial_state=S0,
                                          return_state=True)
        assert (o - want_o).abs().max() < 1e-12 and (S - want_S).abs().max() < 1e-12


def test_the_kda_reference_is_transformers_kimi_linear():
    """A decay per channel: transformers' Kimi Linear recurrent and chunked torch references (float32 inside, q scaled
    by 1/√d_k there, so given √d_k q), max abs diff < 2e-5."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    q, k, v, beta, g, S0 = _kda_inputs(1, C=9)
    o, S = kda_loop(q, k, v, beta, g, S0)
    seq = [t.transpose(1, 2).float() for t in (q * q.shape[-1] ** 0.5, k, v, g)]  # (B, C, H, d)
    hf_o, hf_S = recurrent_kimi_delta_attention(*seq, beta.transpose(1, 2).float(), S0.float(), True)
    assert (hf_o.transpose(1, 2).double() - o).abs().max() < 2e-5 and (hf_S.double() - S).abs().max() < 2e-5
    q_, k_, v_, g_ = seq
    hf_o, hf_S = chunk_kimi_delta_attention(q_, k_, v_, g_, beta.transpose(1, 2).float(), chunk_size=4,
                                            initial_state=S0.float(), output_final_state=True)
    assert (hf_o.transpose(1, 2).double() - o).abs().max() < 2e-5 and (hf_S.double() - S).abs().max() < 2e-5


def test_the_other_ways_equal_the_recurrence():
    args = _kda_inputs(2, C=6, d_k=4, d_v=4)
    want_o, want_S = kda_loop(*args)
    for way in (kda_chunk, kda_by_matrices, kda_chunked):
        o, S = way(*args)
        assert (o - want_o).abs().max() < 1e-12 and (S - want_S).abs().max() < 1e-12, way.__name__


# ---------------------------------------------------------------- 21.2
def indexer_topk(q_idx, k_idx, w, top_k, start):  # the solution's way: scores, causal, topk, scatter
    T_q, T_k = q_idx.shape[0], k_idx.shape[0]
    scores = torch.einsum("thd,sd->ths", q_idx, k_idx).relu()  # (T_q, H_I, T_k)
    scores = (w[:, :, None] * scores).sum(1)  # (T_q, T_k)
    pos = torch.arange(start, start + T_q)[:, None]
    causal = torch.arange(T_k)[None, :] <= pos
    index = scores.masked_fill(~causal, -math.inf).topk(min(top_k, T_k), dim=-1).indices
    return torch.zeros(T_q, T_k, dtype=torch.bool).scatter(-1, index, True) & causal


def indexer_by_loop(q_idx, k_idx, w, top_k, start):  # another way: each query's past keys, sorted
    T_q, T_k = q_idx.shape[0], k_idx.shape[0]
    mask = torch.zeros(T_q, T_k, dtype=torch.bool)
    for t in range(T_q):
        past = start + t + 1
        score = (w[t, :, None] * (q_idx[t] @ k_idx[:past].T).clamp(min=0)).sum(0)  # (past,)
        mask[t, score.argsort(descending=True)[:top_k]] = True
    return mask


def indexer_by_rank(q_idx, k_idx, w, top_k, start):  # another way: a key's rank among the past keys
    T_q, T_k = q_idx.shape[0], k_idx.shape[0]
    scores = torch.einsum("th,ths->ts", w, F.relu(torch.einsum("thd,sd->ths", q_idx, k_idx)))
    causal = torch.arange(T_k)[None, :] <= torch.arange(start, start + T_q)[:, None]
    order = scores.masked_fill(~causal, -math.inf).argsort(-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(T_k).expand(T_q, T_k))
    return (rank < top_k) & causal


def indexer_with(q_idx, k_idx, w, top_k, start, relu="each", weights=True, first=None, strict=False, mask="before",
                 kind="mask"):
    T_q, T_k = q_idx.shape[0], k_idx.shape[0]
    scores = index_scores(q_idx, k_idx, w, relu=relu, weights=weights).float()
    pos = torch.arange(T_q)[:, None] + (start if first is None else first)
    j = torch.arange(T_k)[None, :]
    causal = (j < pos) if strict else (j <= pos)
    if mask == "none":
        out = torch.zeros(T_q, T_k, dtype=torch.bool).scatter(-1, scores.topk(min(top_k, T_k), -1).indices, True)
    elif mask == "after":
        out = torch.zeros(T_q, T_k, dtype=torch.bool).scatter(-1, scores.topk(min(top_k, T_k), -1).indices,
                                                              True) & causal
    else:
        index = scores.masked_fill(~causal, -math.inf).topk(min(top_k, T_k), -1).indices
        out = torch.zeros(T_q, T_k, dtype=torch.bool).scatter(-1, index, True)
        out = out if mask == "padded" else out & causal
    if kind == "indices":
        return index if mask == "before" else out.nonzero()
    return {"mask": out, "float": out.float(), "transposed": out.T}[kind]


def indexer_no_clamp(q_idx, k_idx, w, top_k, start):  # topk asked for more keys than there are
    scores = index_scores(q_idx, k_idx, w).float()
    causal = _allowed(q_idx.shape[0], k_idx.shape[0], start)
    index = scores.masked_fill(~causal, -math.inf).topk(top_k, -1).indices
    return torch.zeros_like(causal).scatter(-1, index, True) & causal


def indexer_through_attnlib(q_idx, k_idx, w, top_k, start):
    scores = index_scores(q_idx, k_idx, w).float()
    return topk_mask(scores, top_k, _allowed(q_idx.shape[0], k_idx.shape[0], start))


def test_the_indexer_reference_is_a_loop_and_attnlibs_topk_mask():
    """The check's scores against a loop over (query, key, head) and its choice against a per-query loop over sorted
    scores and attnlib's topk_mask (float64; keys whose scores tie exactly, at 0 after ReLU, may be chosen either
    way: the choices are compared by the scores they keep)."""
    gen = torch.Generator().manual_seed(0)
    for T_q, T_k, H, d, top_k, start in [(6, 6, 2, 4, 3, 0), (4, 16, 3, 5, 6, 5), (5, 10, 2, 3, 20, 2),
                                         (3, 20, 4, 6, 5, 7)]:
        q_idx, k_idx = torch.randn(T_q, H, d, generator=gen), torch.randn(T_k, d, generator=gen)
        w = torch.randn(T_q, H, generator=gen)
        scores = index_scores(q_idx, k_idx, w)
        loop = torch.zeros(T_q, T_k, dtype=torch.float64)
        for t in range(T_q):
            for s in range(T_k):
                loop[t, s] = sum(w[t, j].item() * max(0.0, float(q_idx[t, j].double() @ k_idx[s].double()))
                                 for j in range(H))
        assert (loop - scores).abs().max() < 1e-12
        allowed = _allowed(T_q, T_k, start)
        assert torch.equal(allowed, torch.ones(T_q, T_k, dtype=torch.bool).tril(start))
        want = _probe(scores, allowed, top_k)
        assert torch.equal(want.sum(-1), allowed.sum(-1).clamp(max=top_k))
        for other in (indexer_by_loop(q_idx.double(), k_idx.double(), w.double(), top_k, start),
                      topk_mask(scores, top_k, allowed)):
            kept = [sorted(scores[t][other[t]].tolist()) for t in range(T_q)]
            assert kept == [sorted(scores[t][want[t]].tolist()) for t in range(T_q)]


def test_the_indexer_reference_is_transformers_deepseek_v32():
    """transformers' DeepseekV32Indexer, its projections set so that it sees the given q, k and w (no RoPE: cos 1,
    sin 0; its LayerNorm on k replaced by the identity), chooses the same keys for the queries with at least top_k
    keys at or before them (it lets the others pick future keys, which its attention's causal mask drops)."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    T, H, d, top_k = 12, 4, 8, 5
    config = DeepseekV32Config(hidden_size=d + H, index_n_heads=H, index_head_dim=d, qk_rope_head_dim=2,
                               index_topk=top_k, q_lora_rank=H * d)
    indexer = DeepseekV32Indexer(config, 0).double().eval()
    gen = torch.Generator().manual_seed(3)
    q_idx, k_idx = torch.randn(T, H, d, generator=gen, dtype=torch.float64), torch.randn(T, d, generator=gen,
                                                                                        dtype=torch.float64)
    w = torch.randn(T, H, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        indexer.wq_b.weight.copy_(torch.eye(H * d, dtype=torch.float64))
        indexer.wk.weight.copy_(torch.eye(d, d + H, dtype=torch.float64))  # k = the first d features
        indexer.weights_proj.weight.copy_(torch.eye(H, d + H, dtype=torch.float64).roll(d, 1))  # w = the last H
    indexer.k_norm = torch.nn.Identity()
    hidden = torch.cat([k_idx, w], -1)[None]  # (1, T, d + H)
    ones, zeros = torch.ones(1, T, 2, dtype=torch.float64), torch.zeros(1, T, 2, dtype=torch.float64)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    index = indexer(hidden, q_idx.reshape(1, T, H * d), (ones, zeros), causal, None)[0]  # (T, top_k)
    got = torch.zeros(T, T, dtype=torch.bool).scatter(-1, index.long(), True)
    want = _probe(index_scores(q_idx, k_idx, w), _allowed(T, T, 0), top_k)
    assert torch.equal(got[top_k - 1:], want[top_k - 1:])
    assert torch.equal(got[:top_k - 1] & causal[0, :top_k - 1], want[:top_k - 1])


# ---------------------------------------------------------------- 21.3
def break_even_context(config):  # the solution's way: the per-layer memory over a full layer's per-token cache
    if config["n_linear"] == 0:
        return None  # the hybrid is the full model
    per_token = 2 * config["n_kv_heads"] * config["head_dim"] * config["dtype_bytes"]
    state = config["n_heads_linear"] * config["d_k"] * config["d_v"] * config["state_bytes"]
    conv = config["conv_kernel"] * config["n_heads_linear"] * (2 * config["d_k"] + config["d_v"]) * config[
        "dtype_bytes"]
    return (state + conv) // per_token + 1


def break_even_by_search(config):  # another way: count the whole models' bytes, one context after another
    c = config
    if c["n_linear"] == 0:
        return None
    kv = 2 * c["n_kv_heads"] * c["head_dim"] * c["dtype_bytes"]
    linear = c["n_heads_linear"] * (c["d_k"] * c["d_v"] * c["state_bytes"]
                                    + c["conv_kernel"] * (2 * c["d_k"] + c["d_v"]) * c["dtype_bytes"])
    T = 0
    while c["n_full"] * kv * T + c["n_linear"] * linear >= (c["n_full"] + c["n_linear"]) * kv * T:
        T += 1
    return T


def break_even_with(config, kv=2, heads="n_kv_heads", state_bytes="state_bytes", conv=0, per_head=True, once=False,
                    rounding="strict", depth=True, never=None):
    c = config
    if c["n_linear"] == 0 and never is None:
        return None
    if not depth:
        return None
    per_token = kv * c[heads] * c["head_dim"] * c["dtype_bytes"]
    linear = (c["n_heads_linear"] if per_head else 1) * c["d_k"] * c["d_v"] * c[state_bytes]
    if conv is not None:
        linear += (c["conv_kernel"] + conv) * c["n_heads_linear"] * (2 * c["d_k"] + c["d_v"]) * c["dtype_bytes"]
    if c["n_linear"] == 0 and never is not None:
        return never
    layers = c["n_linear"] if once else 1
    x = linear / (layers * per_token)
    return {"strict": math.floor(x) + 1, "<=": math.ceil(x), "floor": math.floor(x), "float": x}[rounding] \
        if rounding != "float" else x


def _qwen3_5_bytes(layer_types, T, **sizes):
    """Bytes of the cache a tiny random Qwen3.5 (bfloat16) fills with T tokens: KV, conv and recurrent states."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=len(layer_types),
                               layer_types=layer_types, **sizes)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        cache = model(torch.zeros(1, T, dtype=torch.long), use_cache=True).past_key_values
    tensors = []
    for layer in cache.layers:
        tensors += [getattr(layer, name, None) for name in ("keys", "values")]
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            tensors += list((states or {}).values())
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("sizes", [
    dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=3, linear_key_head_dim=8,
         linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2),
    dict(num_attention_heads=4, num_key_value_heads=1, head_dim=4, linear_conv_kernel_dim=4, linear_key_head_dim=4,
         linear_value_head_dim=8, linear_num_key_heads=3, linear_num_value_heads=3)])
def test_the_break_even_is_where_transformers_qwen3_5_cache_gets_smaller(sizes):
    """A 3:1 Qwen3.5 (bfloat16: its recurrent state in float32, its conv state in bfloat16) against the same model
    with every layer full: at the check's context the hybrid's filled cache is smaller, one token before it is not."""
    hybrid, full = ["linear_attention"] * 3 + ["full_attention"], ["full_attention"] * 4
    config = dict(n_full=1, n_linear=3, n_heads=sizes["num_attention_heads"], n_kv_heads=sizes["num_key_value_heads"],
                  head_dim=sizes["head_dim"], n_heads_linear=sizes["linear_num_value_heads"],
                  d_k=sizes["linear_key_head_dim"], d_v=sizes["linear_value_head_dim"],
                  conv_kernel=sizes["linear_conv_kernel_dim"], dtype_bytes=2, state_bytes=4)
    T = ch21._break_even(config)
    assert T == break_even_context(config) == break_even_by_search(config) > 1
    assert _qwen3_5_bytes(hybrid, T, **sizes) < _qwen3_5_bytes(full, T, **sizes)
    assert _qwen3_5_bytes(hybrid, T - 1, **sizes) >= _qwen3_5_bytes(full, T - 1, **sizes)


ANSWERS = {
    "21.1": Answers(
        correct=[kda_chunk, kda_by_matrices, kda_chunked],
        wrong=[
            (lambda *a: kda_with(*a, scalar=True), "one decay per head"),
            (lambda *a: kda_with(*a, order="after"), "decay first"),
            (lambda *a: kda_with(*a, order="erase, decay"), "decay first"),
            (lambda *a: kda_with(*a, beta_write=False), "without β_t"),
            (lambda *a: kda_with(*a, beta_write=False, beta_erase=False), "you left β out"),
            (lambda *a: kda_with(*a, read="before"), "not S_{t-1}ᵀ q_t"),
            (lambda *a: kda_with(*a, stop=0), "not the state it started from"),
            (lambda *a: kda_with(*a, stop=a[0].shape[2] - 1) if a[0].shape[2] > 1 else kda_with(*a, stop=0),
             "S_C"),
            (lambda *a: kda_with(*a, axis="columns") if a[0].shape[-1] == a[2].shape[-1] else kda_with(*a),
             "not its columns"),
            (lambda *a: kda_with(*a, exp=False), "α_t = exp(g_t)"),
            (lambda *a: kda_with(*a, scale=True), "no 1/√d_k"),
            (lambda *a: kda_with(*a, start=False), "not from zeros"),
            (lambda *a: kda_chunk(*a)[::-1], "in this order"),
            (lambda *a: tuple(t.double() for t in kda_chunk(*a)), "in q's dtype"),
            (kda_through_gated_delta_rule, "without attnlib's attention code"),
            (kda_through_transformers, "transformers' delta-rule functions"),
        ],
    ),
    "21.2": Answers(
        correct=[indexer_topk, indexer_by_loop, indexer_by_rank],
        wrong=[
            (lambda *a: indexer_with(*a, relu="none"), "not Σ_j w_j q_j · k"),
            (lambda *a: indexer_with(*a, relu="sum"), "nor ReLU(Σ_j w_j q_j · k)"),
            (lambda *a: indexer_with(*a, weights=False), "weight each head's score"),
            (lambda *a: indexer_with(*a, mask="none"), "never selects a key after its own position"),
            (lambda *a: indexer_with(*a, mask="after"), "not among every key and then drop"),
            (lambda *a: indexer_with(*a, mask="padded"), "attends all of them and no more"),
            (lambda *a: indexer_with(*a, strict=True), "may select its own key"),
            (lambda *a: indexer_with(*a, first=0), "not t"),
            (lambda *a: indexer_with(*a, first=a[4] + 1), "not start + t + 1"),
            (lambda *a: indexer_with(*a, first=a[4] - 1), "not only those before it"),
            (lambda *a: indexer_with(*a, first=a[1].shape[0] - a[0].shape[0]), "the last T_q positions"),
            (lambda *a: indexer_with(*a, kind="float"), "return a bool mask"),
            (lambda *a: indexer_with(*a, kind="indices"), "scatter the indices"),
            (lambda *a: indexer_with(*a, kind="transposed"), "one row per query"),
            (indexer_no_clamp, "ask topk for no more than there are"),
            (indexer_through_attnlib, "without attnlib's attention code"),
        ],
    ),
    "21.3": Answers(
        correct=[break_even_context, break_even_by_search],
        wrong=[
            (lambda c: break_even_with(c, kv=1), "a key AND a value"),
            (lambda c: break_even_with(c, once=True), "the state is per linear layer"),
            (lambda c: break_even_with(c, rounding="<="), "strictly (<)"),
            (lambda c: break_even_with(c, rounding="floor"), "floor(x) + 1"),
            (lambda c: break_even_with(c, heads="n_heads"), "not the query heads"),
            (lambda c: break_even_with(c, state_bytes="dtype_bytes"), "state_bytes per number"),
            (lambda c: break_even_with(c, conv=None), "short convolution"),
            (lambda c: break_even_with(c, conv=-1), "the cache holds one more"),
            (lambda c: break_even_with(c, per_head=False), "one d_k × d_v matrix per head"),
            (lambda c: break_even_with(c, depth=False), "the same depth"),
            (lambda c: break_even_with(c, never=1), "return None"),
            (lambda c: break_even_with(c, never=math.inf), "not inf, 0 or -1"),
            (lambda c: break_even_with(c, rounding="float"), "return a Python int"),
        ],
    ),
}
