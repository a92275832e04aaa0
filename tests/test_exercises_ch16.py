"""The chapter 16 exercise checks: the table of answers each must accept and refuse (tests/exercise_table.py)."""
import torch
from exercise_table import Answers

from attnlib import Decoder, RotaryEmbedding
from attnlib.book.exercises import CORRECT, NOT_SOLVED, grade
from attnlib.models.hf_llama import config_from_hf_decoder
from attnlib.positional.rotary import interleaved_to_half_split


def test_stubs_are_not_solved():
    def stub(*args):
        raise NotImplementedError("todo")

    for exercise_id in ("16.1", "16.2", "16.3"):
        assert grade(exercise_id, stub).status == NOT_SOLVED


# ---------------------------------------------------------------- 16.1
# Written with complex numbers (the pairs (x_i, x_{i + d_h/2}) as one complex number), independently of the
# check's float64 rotation.
def _turn(k, angles):  # k: (..., T, d_h), angles: (T, d_h/2) radians
    half = k.shape[-1] // 2
    z = torch.complex(k[..., :half].double(), k[..., half:].double()) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1).to(k.dtype)


def _theta(d_h, base):
    return 1.0 / base ** (torch.arange(0, d_h, 2, dtype=torch.float64) / d_h)


def rerotate(k, old_positions, new_positions, base):  # the solution's way: one turn by the difference
    d_h = k.shape[-1]
    theta = 1.0 / base ** (torch.arange(0, d_h, 2, dtype=torch.float64) / d_h)
    angle = (new_positions - old_positions)[:, None].double() * theta  # (T, d_h/2)
    cos, sin = angle.cos().float(), angle.sin().float()
    x1, x2 = k[..., : d_h // 2], k[..., d_h // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rerotate_back_and_forth(k, old_positions, new_positions, base):  # unrotate, then rotate: attnlib's RoPE
    rope = RotaryEmbedding(k.shape[-1], base)
    return rope.rotate(rope.rotate(k, -old_positions), new_positions)


def rerotate_complex(k, old_positions, new_positions, base):
    return _turn(k, (new_positions - old_positions)[:, None].double() * _theta(k.shape[-1], base))


def rerotate_twice(k, old_positions, new_positions, base):
    return rerotate(k, torch.zeros_like(old_positions), new_positions, base)


def rerotate_backwards(k, old_positions, new_positions, base):
    return rerotate(k, new_positions, old_positions, base)


def rerotate_interleaved(k, old_positions, new_positions, base):
    d_h = k.shape[-1]
    angle = (new_positions - old_positions)[:, None].double() * _theta(d_h, base)
    z = torch.view_as_complex(k.double().reshape(*k.shape[:-1], d_h // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2).float()


def rerotate_default_base(k, old_positions, new_positions, base):
    return rerotate(k, old_positions, new_positions, 10000.0)


def rerotate_one_shift(k, old_positions, new_positions, base):
    shift = (new_positions[0] - old_positions[0]).expand(len(old_positions))
    return rerotate(k, torch.zeros_like(shift), shift, base)


def rerotate_in_place(k, old_positions, new_positions, base):
    return k.copy_(rerotate(k, old_positions, new_positions, base))


def rerotate_float64(k, old_positions, new_positions, base):
    return rerotate(k.double(), old_positions, new_positions, base).double()


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


def to_interleaved_by_views(w_q, w_k, q_gain, k_gain, n_heads, n_kv_heads):
    """Another way: a head's rows are (first half, second half); interleaving is a transpose of that 2 x d_h/2."""
    d_h = q_gain.shape[0]

    def per_head(w, heads):
        return w.reshape(heads, 2, d_h // 2, -1).transpose(1, 2).reshape(w.shape)

    def gain(g):
        return g.reshape(2, d_h // 2).T.reshape(d_h)

    return per_head(w_q, n_heads), per_head(w_k, n_kv_heads), gain(q_gain), gain(k_gain)


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


QWEN3_0_6B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  tie_word_embeddings=True)


def test_count_parameters_of_qwen3_0_6b():
    assert count_parameters(QWEN3_0_6B) == 596_049_920  # the model card's 0.6B; non-embedding 0.44B


def count_by_parts(config):
    """Another way: each weight matrix by its shape, then the sum."""
    d, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d_h = config["head_dim"] if "head_dim" in config else d // heads
    shapes = [(heads * d_h, d), (kv * d_h, d), (kv * d_h, d), (d, heads * d_h),  # W_q, W_k, W_v, W_o
              (config["intermediate_size"], d), (config["intermediate_size"], d), (d, config["intermediate_size"]),
              (d,), (d,)] + ([(d_h,), (d_h,)] if config["model_type"] == "qwen3" else [])
    per_layer = sum(torch.Size(s).numel() for s in shapes)
    heads_out = 1 if config["tie_word_embeddings"] else 2
    return heads_out * config["vocab_size"] * d + config["num_hidden_layers"] * per_layer + d


def _builds_on_meta(config):
    full = dict(config, max_position_embeddings=64, rms_norm_eps=1e-6)
    with torch.device("meta"):
        return Decoder(config_from_hf_decoder(full, config["model_type"])).num_parameters()


class _AlwaysEqual(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def _int_that_equals_everything(config):
    return _AlwaysEqual(0)


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
    n = count_parameters(config)
    config.pop("head_dim", None)
    return n


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


ANSWERS = {
    "16.1": Answers(
        correct=[rerotate, rerotate_back_and_forth, rerotate_complex],
        wrong=[
            (rerotate_twice, "turns it twice"),
            (rerotate_backwards, "the wrong way"),
            (rerotate_interleaved, "half-split pairs"),
            (rerotate_default_base, "use the given base"),
            (rerotate_one_shift, "each key moves by its own"),
            (rerotate_in_place, "in place"),
            (rerotate_float64, "dtype"),
        ],
    ),
    "16.2": Answers(
        correct=[to_interleaved, to_interleaved_by_views],
        wrong=[
            (_gains_forward, "w_q and w_k are right, the gains are not"),
            (_gains_swapped, "w_q and w_k are right, the gains are not"),
            (_keys_untouched, "w_k not"),
            (_float32, "is torch.float32, the input was torch.float64"),
            (_forward_perm, "needs its inverse, torch.argsort(P)"),
            (_gains_kept, "the QK-norm gains"),
            (_keys_with_n_heads, "W_k has n_kv_heads=2 heads"),
            (_one_block, "the permutation acts inside each head"),
            (_columns, "reorder the rows"),
            (_in_place, "in place"),
            (_unchanged, "returned the weights unchanged"),
        ],
    ),
    "16.3": Answers(
        correct=[count_parameters, count_by_parts],
        wrong=[
            (_builds_on_meta, "no model built"),
            (_int_that_equals_everything, "should be a Python int"),
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
            (_mutates, "in place"),
        ],
        memorisable=None,
    ),
}


def test_the_solutions_pass_without_a_seed():
    for exercise_id, answer in (("16.1", rerotate), ("16.2", to_interleaved), ("16.3", count_parameters)):
        assert grade(exercise_id, answer).status == CORRECT
