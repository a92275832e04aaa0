"""The chapter 16 exercise checks: a reference answer is correct, a plausible mistake is wrong."""
import math

import pytest
import torch

from attnlib import RotaryEmbedding
from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, ch16, grade
from attnlib.positional.rotary import interleaved_to_half_split


def _verdict(exercise_id, answer, status, phrase=None):
    verdict = grade(exercise_id, answer)
    assert verdict.status == status, verdict
    if phrase is not None:
        assert phrase in verdict.detail, verdict
    return verdict


def test_stubs_are_not_solved():
    def stub(*args):
        raise NotImplementedError("todo")

    for exercise_id in ("16.1", "16.2", "16.3"):
        _verdict(exercise_id, stub, NOT_SOLVED)


# ---------------------------------------------------------------- 16.1
def swiglu_hidden(d_model, multiple_of, ffn_dim_multiplier=None):
    hidden = int(2 * (4 * d_model) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def test_swiglu_hidden_reproduces_the_published_widths():
    assert swiglu_hidden(4096, 256) == 11008  # Llama 2 7B
    assert swiglu_hidden(4096, 1024, 1.3) == 14336  # Llama 3 8B
    assert swiglu_hidden(16384, 4096, 1.2) == 53248  # Llama 3.1 405B
    _verdict("16.1", swiglu_hidden, CORRECT)


def _four_d(d, m, mult=None):
    hidden = int((mult or 1.0) * 4 * d)
    return m * math.ceil(hidden / m)


def _round_down(d, m, mult=None):
    hidden = int(int(2 * 4 * d / 3) * (mult or 1.0))
    return m * (hidden // m)


def _no_multiplier(d, m, mult=None):
    return swiglu_hidden(d, m, None)


def _one_truncation(d, m, mult=None):
    hidden = int((mult or 1.0) * 8 * d / 3)
    return m * math.ceil(hidden / m)


def _rounds(d, m, mult=None):
    hidden = round((mult or 1.0) * round(8 * d / 3))
    return m * math.ceil(hidden / m)


def _float(d, m, mult=None):
    return float(swiglu_hidden(d, m, mult))


def _not_rounded_to_multiple(d, m, mult=None):
    return int((mult or 1.0) * int(8 * d / 3))


def _ceil_first(d, m, mult=None):
    hidden = math.ceil(8 * d / 3)
    if mult is not None:
        hidden = int(mult * hidden)
    return m * math.ceil(hidden / m)


def _ceil_second(d, m, mult=None):
    hidden = int(8 * d / 3)
    if mult is not None:
        hidden = math.ceil(mult * hidden)
    return m * math.ceil(hidden / m)


def _multiplier_first(d, m, mult=None):
    hidden = int(2 * int((mult or 1.0) * 4 * d) / 3)
    return m * math.ceil(hidden / m)


def _one_more_multiple(d, m, mult=None):
    hidden = int(int(8 * d / 3) * (mult or 1.0))
    return m * (hidden // m + 1)


@pytest.mark.parametrize(
    ("answer", "phrase"),
    [
        (_ceil_first, "you rounded 2/3 * 4 * d_model up"),
        (_ceil_second, "times ffn_dim_multiplier up"),
        (_multiplier_first, "before taking 2/3 of it"),
        (_one_more_multiple, "rounding up leaves a multiple unchanged"),
        (_four_d, "SwiGLU has three matrices"),
        (_round_down, "rounds up, to the next multiple"),
        (_no_multiplier, "you ignored ffn_dim_multiplier"),
        (_one_truncation, "calls int() twice"),
        (_rounds, "int() truncates, round() rounds"),
        (_float, "return a Python int"),
        (_not_rounded_to_multiple, "did not round to a multiple"),
    ],
)
def test_swiglu_hidden_mistakes(answer, phrase):
    _verdict("16.1", answer, WRONG, phrase)


# ---------------------------------------------------------------- 16.2
def _order(d_h):
    return torch.cat([torch.arange(0, d_h, 2), torch.arange(1, d_h, 2)])


def to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    d_h = q_gain.shape[0]
    inverse = torch.argsort(_order(d_h))

    def per_head(w, heads):
        return w.reshape(heads, d_h, -1)[:, inverse].reshape(w.shape)

    return per_head(w_q, n_heads), per_head(w_k, n_kv_heads), q_gain[inverse], k_gain[inverse]


def test_to_interleaved_is_the_inverse_of_the_library_conversion():
    w = torch.randn(4 * 8, 16)
    w_i, _, _, _ = to_interleaved(w, w[:16], torch.ones(8), torch.ones(8), 4, 2)
    torch.testing.assert_close(interleaved_to_half_split(w_i, 4), w)
    _verdict("16.2", to_interleaved, CORRECT)


def test_the_checkers_half_split_rope_is_attnlibs():
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    expected = RotaryEmbedding(8).rotate(x.float(), torch.arange(5))
    torch.testing.assert_close(ch16._half_split_rope(x, torch.arange(5)).float(), expected)


def _forward_perm(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    d_h = q_gain.shape[0]
    P = _order(d_h)
    return (interleaved_to_half_split(w_q, n_heads), interleaved_to_half_split(w_k, n_kv_heads), q_gain[P],
            k_gain[P])


def _gains_kept(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    w_q, w_k, _, _ = to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads)
    return w_q, w_k, q_gain, k_gain


def _keys_with_n_heads(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    d_h = q_gain.shape[0]
    inverse = torch.argsort(_order(d_h))
    small = torch.argsort(_order(w_k.shape[0] // n_heads))
    return (w_q.reshape(n_heads, d_h, -1)[:, inverse].reshape(w_q.shape),
            w_k.reshape(n_heads, -1, w_k.shape[1])[:, small].reshape(w_k.shape), q_gain[inverse], k_gain[inverse])


def _one_block(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    _, _, q_g, k_g = to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads)
    return w_q[torch.argsort(_order(w_q.shape[0]))], w_k[torch.argsort(_order(w_k.shape[0]))], q_g, k_g


def _columns(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    _, _, q_g, k_g = to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads)
    cols = torch.argsort(_order(w_q.shape[1]))
    return w_q[:, cols], w_k[:, cols], q_g, k_g


def _in_place(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    out = to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads)
    for target, value in zip((w_q, w_k, q_gain, k_gain), out):
        target.copy_(value)
    return w_q, w_k, q_gain, k_gain


def _unchanged(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    return w_q.clone(), w_k.clone(), q_gain.clone(), k_gain.clone()


def _gains_forward(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    w_q, w_k, _, _ = to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads)
    P = _order(q_gain.shape[0])
    return w_q, w_k, q_gain[P], k_gain[P]


def _gains_swapped(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    w_q, w_k, q_g, k_g = to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads)
    return w_q, w_k, k_g, q_g


def _keys_untouched(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    w_q, _, q_g, k_g = to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads)
    return w_q, w_k.clone(), q_g, k_g


def _float32(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    return tuple(t.float() for t in to_interleaved(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads))


@pytest.mark.parametrize(
    ("answer", "phrase"),
    [
        (_gains_forward, "w_q and w_k are right, the gains are not"),
        (_gains_swapped, "w_q and w_k are right, the gains are not"),
        (_keys_untouched, "w_k not"),
        (_float32, "is torch.float32, the input was torch.float64"),
        (_forward_perm, "needs its inverse, torch.argsort(P)"),
        (_gains_kept, "the QK-norm gains"),
        (_keys_with_n_heads, "W_k has n_kv_heads=2 heads"),
        (_one_block, "the permutation acts inside each head"),
        (_columns, "reorder the rows"),
        (_in_place, "changed its inputs in place"),
        (_unchanged, "returned the weights unchanged"),
    ],
)
def test_to_interleaved_mistakes(answer, phrase):
    _verdict("16.2", answer, WRONG, phrase)


# ---------------------------------------------------------------- 16.3
def count_parameters(config):
    V, d, L = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]
    h, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d_h = config.get("head_dim") or d // h
    attention = 2 * d * h * d_h + 2 * d * kv * d_h
    if config["model_type"] == "qwen3":
        attention += 2 * d_h  # QK-norm gains
    per_layer = attention + 3 * d * config["intermediate_size"] + 2 * d
    head = 0 if config["tie_word_embeddings"] else V * d
    return V * d + L * per_layer + d + head


def test_count_parameters_of_qwen3_0_6b():
    assert count_parameters(ch16.QWEN3_0_6B) == 596_049_920
    _verdict("16.3", count_parameters, CORRECT)


def _tied_twice(config):
    return count_parameters(dict(config, tie_word_embeddings=False))


def _no_head_dim(config):
    return count_parameters({k: v for k, v in config.items() if k != "head_dim"})


def _mha(config):
    return count_parameters(dict(config, num_key_value_heads=config["num_attention_heads"]))


def _no_qk_norm(config):
    return count_parameters(dict(config, model_type="llama"))


def _no_norms(config):
    return count_parameters(config) - (2 * config["num_hidden_layers"] + 1) * config["hidden_size"]


def _two_matrices(config):
    return count_parameters(config) - config["num_hidden_layers"] * config["intermediate_size"] * config["hidden_size"]


def _mutates(config):
    config["tie_word_embeddings"] = bool(config["tie_word_embeddings"])
    config.pop("head_dim", None)
    return count_parameters(config)


def _head_width(config):
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _qk_norm_per_head(config):
    n = count_parameters(config)
    if config["model_type"] == "qwen3":
        extra = config["num_attention_heads"] + config["num_key_value_heads"] - 2
        n += config["num_hidden_layers"] * extra * _head_width(config)
    return n


def _qk_norm_of_width_d(config):
    n = count_parameters(config)
    if config["model_type"] == "qwen3":
        n += config["num_hidden_layers"] * 2 * (config["hidden_size"] - _head_width(config))
    return n


def _out_proj_with_kv_heads(config):
    shared = config["num_attention_heads"] - config["num_key_value_heads"]
    return count_parameters(config) - (config["num_hidden_layers"] * config["hidden_size"] * shared
                                       * _head_width(config))


def _keys_and_values_one_matrix(config):
    kv = config["num_key_value_heads"] * _head_width(config)
    return count_parameters(config) - config["num_hidden_layers"] * config["hidden_size"] * kv


def _qkv_biases(config):
    width = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * _head_width(config)
    return count_parameters(config) + config["num_hidden_layers"] * width


def _one_norm_per_layer(config):
    return count_parameters(config) - config["num_hidden_layers"] * config["hidden_size"]


def _always_tied(config):
    return count_parameters(dict(config, tie_word_embeddings=True))


@pytest.mark.parametrize(
    ("answer", "phrase"),
    [
        (_qk_norm_per_head, "shared by all the heads of a layer"),
        (_qk_norm_of_width_d, "the QK-norm gains have head_dim numbers"),
        (_out_proj_with_kv_heads, "W_O takes all num_attention_heads heads"),
        (_keys_and_values_one_matrix, "keys and values are two matrices"),
        (_qkv_biases, "no biases"),
        (_one_norm_per_layer, "you counted one"),
        (_always_tied, "the head is not tied here"),
        (_tied_twice, "count it once"),
        (_no_head_dim, "the head width is head_dim"),
        (_mha, "(GQA), not num_attention_heads"),
        (_no_qk_norm, "QK-norm adds two gains"),
        (_no_norms, "the RMSNorm gains are parameters too"),
        (_two_matrices, "SwiGLU has three matrices"),
        (_mutates, "changed the config dict"),
    ],
)
def test_count_parameters_mistakes(answer, phrase):
    _verdict("16.3", answer, WRONG, phrase)
