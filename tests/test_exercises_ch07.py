"""The chapter 07 exercise checks: a reference answer is correct, a plausible mistake is wrong, a stub is not solved."""
import math

import pytest
import torch

from attnlib import GPTConfig
from attnlib.attention import ATTENTION_REGISTRY, MultiHeadLatentAttention
from attnlib.book.exercises import CORRECT, WRONG, grade


# ---------------------------------------------------------------- 07.1
def _scores(q, c, w_uk, n_heads, scale_width=None, split="heads_first"):
    head_dim, d_c = q.shape[-1], c.shape[-1]
    if split == "heads_first":
        w = w_uk.view(n_heads, head_dim, d_c)
    else:  # the interleaved reading of the rows: not how split_heads lays out heads
        w = w_uk.view(head_dim, n_heads, d_c).transpose(0, 1)
    q_latent = torch.einsum("bhtd,hdc->bhtc", q, w)  # (B, n_heads, T_q, d_c)
    return q_latent @ c.unsqueeze(1).transpose(-2, -1) / math.sqrt(scale_width or head_dim)


def absorbed_scores(q, c, w_uk, n_heads):
    return _scores(q, c, w_uk, n_heads)


def absorbed_scores_d_c_scale(q, c, w_uk, n_heads):
    return _scores(q, c, w_uk, n_heads, scale_width=c.shape[-1])


def absorbed_scores_interleaved(q, c, w_uk, n_heads):
    return _scores(q, c, w_uk, n_heads, split="interleaved")


def scores_by_decoding_keys(q, c, w_uk, n_heads):
    B, T_k, _ = c.shape
    k = (c @ w_uk.T).view(B, T_k, n_heads, -1).transpose(1, 2)  # right numbers, but the keys are built
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


# ---------------------------------------------------------------- 07.2
def fold_output(v_up_weight, out_proj_weight, n_heads):
    d_model, d_c = out_proj_weight.shape[0], v_up_weight.shape[1]
    w_uv = v_up_weight.view(n_heads, -1, d_c)
    w_o = out_proj_weight.view(d_model, n_heads, -1)
    return torch.einsum("mhd,hdc->hcm", w_o, w_uv)


def fold_output_untransposed(v_up_weight, out_proj_weight, n_heads):
    return fold_output(v_up_weight, out_proj_weight, n_heads).transpose(1, 2)


def fold_output_by_rows(v_up_weight, out_proj_weight, n_heads):
    d_model, d_c = out_proj_weight.shape[0], v_up_weight.shape[1]
    w_uv = v_up_weight.view(n_heads, -1, d_c)
    w_o = out_proj_weight.view(n_heads, -1, d_model)  # rows: the heads are the inputs, not the outputs
    return torch.einsum("hdc,hdm->hcm", w_uv, w_o)


def fold_output_summed(v_up_weight, out_proj_weight, n_heads):
    return fold_output(v_up_weight, out_proj_weight, n_heads).sum(0)


def fold_output_in_place(v_up_weight, out_proj_weight, n_heads):
    result = fold_output(v_up_weight, out_proj_weight, n_heads)
    out_proj_weight.zero_()
    return result


# ---------------------------------------------------------------- 07.3
def kv_cache_bytes(config, seq_len, rope_dim, dtype_bytes):  # the sizes as given; None = the config's default
    n_kv_heads = config.n_heads if config.n_kv_heads is None else config.n_kv_heads
    d_c = config.d_model // 4 if config.kv_latent_dim is None else config.kv_latent_dim
    per_token = {
        "mha": 2 * config.n_heads * config.head_dim,
        "gqa": 2 * n_kv_heads * config.head_dim,
        "mqa": 2 * config.head_dim,
        "mla": d_c + rope_dim,
    }[config.attention]
    return per_token * config.n_layers * seq_len * dtype_bytes


def kv_cache_bytes_properties(config, seq_len, rope_dim, dtype_bytes):  # the config's effective sizes: also right
    per_token = {
        "mha": 2 * config.kv_heads * config.head_dim,
        "gqa": 2 * config.kv_heads * config.head_dim,
        "mqa": 2 * config.kv_heads * config.head_dim,
        "mla": config.latent_dim + rope_dim,
    }[config.attention]
    return per_token * config.n_layers * seq_len * dtype_bytes


def kv_cache_bytes_given_sizes(config, seq_len, rope_dim, dtype_bytes):  # n_kv_heads / kv_latent_dim may be None
    per_token = {
        "mha": 2 * config.n_heads * config.head_dim,
        "gqa": 2 * config.n_kv_heads * config.head_dim,
        "mqa": 2 * config.head_dim,
        "mla": config.kv_latent_dim + rope_dim,
    }[config.attention]
    return per_token * config.n_layers * seq_len * dtype_bytes


def kv_cache_bytes_one_layer(config, seq_len, rope_dim, dtype_bytes):
    return kv_cache_bytes(config, seq_len, rope_dim, dtype_bytes) // config.n_layers


def kv_cache_bytes_no_rope(config, seq_len, rope_dim, dtype_bytes):
    return kv_cache_bytes(config, seq_len, 0, dtype_bytes)


def kv_cache_bytes_latent_twice(config, seq_len, rope_dim, dtype_bytes):
    extra = config.latent_dim + rope_dim if config.attention == "mla" else 0
    return kv_cache_bytes(config, seq_len, rope_dim, dtype_bytes) + extra * config.n_layers * seq_len * dtype_bytes


def kv_cache_bytes_gqa_all_heads(config, seq_len, rope_dim, dtype_bytes):
    if config.attention == "gqa":
        return 2 * config.n_heads * config.head_dim * config.n_layers * seq_len * dtype_bytes
    return kv_cache_bytes(config, seq_len, rope_dim, dtype_bytes)


def kv_cache_bytes_rope_everywhere(config, seq_len, rope_dim, dtype_bytes):
    extra = 0 if config.attention == "mla" else rope_dim
    return kv_cache_bytes(config, seq_len, rope_dim, dtype_bytes) + extra * config.n_layers * seq_len * dtype_bytes


def kv_cache_bytes_float(config, seq_len, rope_dim, dtype_bytes):
    return float(kv_cache_bytes(config, seq_len, rope_dim, dtype_bytes))


REFERENCE = [("07.1", absorbed_scores), ("07.2", fold_output), ("07.3", kv_cache_bytes)]


@pytest.mark.parametrize("exercise_id, answer", REFERENCE + [("07.3", kv_cache_bytes_properties)])
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("07.1", absorbed_scores_d_c_scale, "1/sqrt(head_dim)"),
        ("07.1", absorbed_scores_interleaved, "w_uk.view(n_heads, head_dim, d_c)"),
        ("07.1", scores_by_decoding_keys, "fold w_uk into q"),
        ("07.2", fold_output_untransposed, "transpose"),
        ("07.2", fold_output_by_rows, "columns"),
        ("07.2", fold_output_summed, "one matrix per head"),
        ("07.2", fold_output_in_place, "changed the weights"),
        ("07.3", kv_cache_bytes_one_layer, "n_layers"),
        ("07.3", kv_cache_bytes_no_rope, "k^R_t"),
        ("07.3", kv_cache_bytes_latent_twice, "cache d_c + rope_dim numbers, not twice"),
        ("07.3", kv_cache_bytes_gqa_all_heads, "n_kv_heads"),
        ("07.3", kv_cache_bytes_rope_everywhere, "rope_dim only concerns MLA"),
        ("07.3", kv_cache_bytes_float, "Python int"),
        ("07.3", kv_cache_bytes_given_sizes, "config.kv_heads and config.latent_dim"),
    ],
)
def test_plausible_mistake_is_wrong(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


def test_reference_answers_agree_with_the_library():
    """The exercises' references agree with the library's MLA and its layers' cache_width."""
    config = GPTConfig(d_model=24, n_heads=4, kv_latent_dim=10, n_layers=3, block_size=8, attention="mla")
    torch.manual_seed(3)
    mla = MultiHeadLatentAttention(24, 4, 10).eval()
    x = torch.randn(2, 6, config.d_model)
    with torch.no_grad():
        # 07.1: the absorbed scores are the naive path's scores
        q, k, _ = mla.project(x)
        scores = absorbed_scores(q, mla.latent(x), mla.k_up.weight, config.n_heads)
        torch.testing.assert_close(scores, q @ k.transpose(-2, -1) / math.sqrt(config.head_dim))
        # 07.2: the folded matrices turn the absorbed path's weighted latents into the module's output
        mla.absorb = True
        q_latent, c, _ = mla.project(x)
        y_latent, _ = mla.attend(q_latent, c, c, None, True, False)
        w = fold_output(mla.v_up.weight, mla.out_proj.weight, config.n_heads)
        out = torch.einsum("bhtc,hcm->btm", y_latent, w) + mla.out_proj.bias
        mla.absorb = False
        torch.testing.assert_close(out, mla(x))
    # 07.3: Table 1 equals each layer's cache_width
    for variant in ("mha", "gqa", "mqa", "mla"):
        sized = {"gqa": dict(n_kv_heads=2), "mla": dict(kv_latent_dim=10)}.get(variant, {})
        config_v = GPTConfig(d_model=24, n_heads=4, n_layers=3, block_size=8, attention=variant, **sized)
        expected = ATTENTION_REGISTRY[variant](config_v).cache_width * config_v.n_layers * 5 * 2
        assert kv_cache_bytes(config_v, 5, 0, 2) == expected
