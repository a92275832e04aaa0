"""Helpers of exercise check 16.3 (a decoder's parameters by formula): the plausible slips and their hints.

:mod:`ch16` registers the check; its reference is :class:`attnlib.Decoder` built on the meta device,
and these rules serve only to name a learner's mistake.
"""
from __future__ import annotations


def _formula(c: dict) -> int:
    """The count by formula (used only to recognise mistakes; the reference is the model itself)."""
    V, d, L = c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d_h = c.get("head_dim") or d // h
    attention = 2 * d * h * d_h + 2 * d * kv * d_h + (2 * d_h if c["model_type"] == "qwen3" else 0)
    return V * d + L * (attention + 3 * d * c["intermediate_size"] + 2 * d) + d + (0 if c["tie_word_embeddings"]
                                                                                   else V * d)


def _sizes(c: dict) -> tuple[int, int, int, int, int, int, bool]:
    d, h = c["hidden_size"], c["num_attention_heads"]
    return (c["vocab_size"], d, c["num_hidden_layers"], h, c["num_key_value_heads"], c.get("head_dim") or d // h,
            c["model_type"] == "qwen3")


def _slip(change):
    """A rule: the right count of a config plus ``change(V, d, L, h, kv, d_h, qwen3, config)``."""
    return lambda c: _formula(c) + change(*_sizes(c), c)


# Counts a learner gets from plausible slips, each as a rule over the config, with its hint. A hint is given only
# when its rule gives the learner's count for every config, so slips that agree on one model are told apart.
COUNT_MISTAKES = [
    (_slip(lambda V, d, L, h, kv, d_h, q, c: V * d if c["tie_word_embeddings"] else 0),
     "the head is tied (tie_word_embeddings=True): it is the embedding's matrix, count it once"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: 0 if c["tie_word_embeddings"] else -V * d),
     "the head is not tied here (tie_word_embeddings=False): it has its own |V| x d matrix"),
    (lambda c: _formula({k: v for k, v in c.items() if k != "head_dim"}), "the head width is head_dim, "
     "not hidden_size / heads: W_q has num_attention_heads * head_dim rows"),
    (lambda c: _formula(dict(c, num_key_value_heads=c["num_attention_heads"])), "keys and values have "
     "num_key_value_heads heads (GQA), not num_attention_heads"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -L * d * (h - kv) * d_h), "W_O takes all num_attention_heads heads "
     "back to d: it has num_attention_heads * head_dim x hidden_size weights, like W_q (only W_k and W_v are "
     "shared)"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -L * d * kv * d_h), "keys and values are two matrices, W_k and W_v, "
     "each num_key_value_heads * head_dim x hidden_size"),
    (lambda c: _formula(dict(c, model_type="llama")) if c["model_type"] == "qwen3" else None,
     "Qwen3's QK-norm adds two gains of head_dim per layer"),
    (lambda c: _formula(dict(c, model_type="qwen3")) if c["model_type"] == "llama" else None,
     "Llama has no QK-norm: no per-head gains"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: L * (h + kv - 2) * d_h if q else 0), "QK-norm has one gain of "
     "head_dim for the queries and one for the keys, shared by all the heads of a layer, not one per head"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: 2 * L * (d - d_h) if q else 0), "the QK-norm gains have head_dim "
     "numbers, not hidden_size: the norm runs over each head's d_h numbers"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: L * (h + 2 * kv) * d_h), "the projections have no biases "
     "(Qwen2 had q/k/v biases; Llama and Qwen3 have none)"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -(2 * L + 1) * d),
     "the RMSNorm gains are parameters too: two per layer and a final one"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -L * 2 * d), "two RMSNorm gains per layer (before attention, before "
     "the MLP)"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -L * d), "two RMSNorm gains per layer (before attention, before the "
     "MLP); you counted one"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -d), "the final RMSNorm has a gain of d parameters"),
    (_slip(lambda V, d, L, h, kv, d_h, q, c: -L * c["intermediate_size"] * d),
     "SwiGLU has three matrices: gate, up and down"),
]

