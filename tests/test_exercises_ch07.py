"""The chapter 07 exercise checks: a reference answer is correct, a plausible mistake is wrong, a stub is not solved."""
import math

import pytest
import torch

from attnlib import GPTConfig
from attnlib.attention import MultiHeadLatentAttention
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
def fold_query(q_weight, q_bias, w_uk, n_heads):
    d_c = w_uk.shape[1]
    w_q = q_weight.view(n_heads, -1, q_weight.shape[1])  # (h, hd, d): W^q_h
    b_q = q_bias.view(n_heads, -1)  # (h, hd)
    uk_t = w_uk.view(n_heads, -1, d_c).transpose(1, 2)  # (h, d_c, hd): W^UK_h^T
    return uk_t @ w_q, torch.einsum("hcd,hd->hc", uk_t, b_q)


def fold_query_no_bias(q_weight, q_bias, w_uk, n_heads):
    a, c = fold_query(q_weight, q_bias, w_uk, n_heads)
    return a, torch.zeros_like(c)


def fold_query_transposed_shape(q_weight, q_bias, w_uk, n_heads):
    a, c = fold_query(q_weight, q_bias, w_uk, n_heads)
    return a.transpose(1, 2), c


def fold_query_reshaped_w_uk(q_weight, q_bias, w_uk, n_heads):
    uk_t = w_uk.reshape(n_heads, w_uk.shape[1], -1)  # (hd, d_c) blocks read as (d_c, hd): not a transpose
    w_q = q_weight.view(n_heads, -1, q_weight.shape[1])
    return uk_t @ w_q, (uk_t @ q_bias.view(n_heads, -1, 1)).squeeze(-1)


def fold_query_interleaved(q_weight, q_bias, w_uk, n_heads):
    d, d_c = q_weight.shape[1], w_uk.shape[1]
    w_q = q_weight.view(-1, n_heads, d).transpose(0, 1)  # rows h, h + n_heads, ...: not split_heads' layout
    b_q = q_bias.view(-1, n_heads).T
    uk_t = w_uk.view(-1, n_heads, d_c).permute(1, 2, 0)
    return uk_t @ w_q, torch.einsum("hcd,hd->hc", uk_t, b_q)


def fold_query_scaled(q_weight, q_bias, w_uk, n_heads):
    a, c = fold_query(q_weight, q_bias, w_uk, n_heads)
    head_dim = q_weight.shape[0] // n_heads
    return a / math.sqrt(head_dim), c / math.sqrt(head_dim)


def fold_query_in_place(q_weight, q_bias, w_uk, n_heads):
    a, c = fold_query(q_weight, q_bias, w_uk, n_heads)
    q_bias.zero_()
    return a, c


def fold_query_bias_unfolded(q_weight, q_bias, w_uk, n_heads):
    a, _ = fold_query(q_weight, q_bias, w_uk, n_heads)
    return a, q_bias.view(n_heads, -1)


# ---------------------------------------------------------------- 07.3
def _split(t, n_heads):
    B, T, _ = t.shape
    return t.view(B, T, n_heads, -1).transpose(1, 2)


def _step(layer, x_new, cache, rope, *, scale_width=None, q_shift=0, rotate_key=True,
          use_rope=True, decode_keys=False, see_self=True):
    c_cache, kr_cache = cache
    t = c_cache.shape[1]  # tokens already cached: the new token's position
    h, hd = layer.n_heads, layer.head_dim
    c = torch.cat([c_cache, layer.kv_down(x_new)], dim=1)  # (B, t+1, d_c)
    k_r_new = layer.k_rope(x_new)
    if rotate_key:
        k_r_new = rope(k_r_new, torch.tensor([t]))
    k_r = torch.cat([kr_cache, k_r_new], dim=1)  # (B, t+1, rope_dim)
    q_c = _split(layer.q_proj(x_new), h)  # (B, h, 1, hd)
    q_r = rope(_split(layer.q_rope(x_new), h), torch.tensor([t + q_shift]))  # (B, h, 1, rd)
    if decode_keys:  # right numbers, but every cached latent is decoded into keys
        scores = q_c @ _split(layer.k_up(c), h).transpose(-2, -1)
    else:
        w_uk = layer.k_up.weight.view(h, hd, -1)  # W^UK_h: (h, hd, d_c)
        q_latent = torch.einsum("bhtd,hdc->bhtc", q_c, w_uk)  # (B, h, 1, d_c)
        scores = q_latent @ c.unsqueeze(1).transpose(-2, -1)  # (B, h, 1, t+1)
    if use_rope:
        scores = scores + q_r @ k_r.unsqueeze(1).transpose(-2, -1)
    width = scale_width(layer) if scale_width else hd + layer.rope_dim
    keys = c
    if not see_self and t > 0:  # attends over the old cache only, appends afterwards
        scores, keys = scores[..., :t], c[:, :t]
    weights = (scores / math.sqrt(width)).softmax(-1)  # one query sees every cached key
    y_latent = weights @ keys.unsqueeze(1)  # (B, h, 1, d_c)
    w_uv = layer.v_up.weight.view(h, hd, -1)  # W^UV_h
    y = torch.einsum("bhtc,hdc->bhtd", y_latent, w_uv)  # (B, h, 1, hd)
    out = layer.out_proj(y.transpose(1, 2).reshape(x_new.shape[0], 1, -1))
    return out, (c, k_r)


def absorbed_decode_step(layer, x_new, cache, rope):
    return _step(layer, x_new, cache, rope)


def decode_step_scale_head_dim(layer, x_new, cache, rope):
    return _step(layer, x_new, cache, rope, scale_width=lambda m: m.head_dim)


def decode_step_scale_latent(layer, x_new, cache, rope):
    return _step(layer, x_new, cache, rope, scale_width=lambda m: m.kv_latent_dim + m.rope_dim)


def decode_step_query_off_by_one(layer, x_new, cache, rope):
    return _step(layer, x_new, cache, rope, q_shift=1)


def decode_step_key_unrotated(layer, x_new, cache, rope):
    return _step(layer, x_new, cache, rope, rotate_key=False)


def decode_step_no_rope(layer, x_new, cache, rope):
    return _step(layer, x_new, cache, rope, use_rope=False)


def decode_step_decoded_keys(layer, x_new, cache, rope):
    return _step(layer, x_new, cache, rope, decode_keys=True)


def decode_step_attends_before_appending(layer, x_new, cache, rope):
    return _step(layer, x_new, cache, rope, see_self=False)


REFERENCE = [("07.1", absorbed_scores), ("07.2", fold_query), ("07.3", absorbed_decode_step)]


@pytest.mark.parametrize("exercise_id, answer", REFERENCE)
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("07.1", absorbed_scores_d_c_scale, "1/sqrt(head_dim)"),
        ("07.1", absorbed_scores_interleaved, "w_uk.view(n_heads, head_dim, d_c)"),
        ("07.1", scores_by_decoding_keys, "fold w_uk into q"),
        ("07.2", fold_query_no_bias, "the query bias is dropped"),
        ("07.2", fold_query_transposed_shape, "W^UK is transposed"),
        ("07.2", fold_query_reshaped_w_uk, "read with its axes swapped"),
        ("07.2", fold_query_interleaved, "the heads are interleaved"),
        ("07.2", fold_query_scaled, "with no scale"),
        ("07.2", fold_query_in_place, "changed the weights"),
        ("07.2", fold_query_bias_unfolded, "split into heads but not folded"),
        ("07.3", decode_step_scale_head_dim, "1/sqrt(head_dim + rope_dim)"),
        ("07.3", decode_step_scale_latent, "the width of the absorbed vectors"),
        ("07.3", decode_step_query_off_by_one, "positions count from 0"),
        ("07.3", decode_step_key_unrotated, "cached unrotated"),
        ("07.3", decode_step_no_rope, "rotary part is missing"),
        ("07.3", decode_step_decoded_keys, "never compute k_up(cache)"),
        ("07.3", decode_step_attends_before_appending, "does not attend to itself"),
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
        # 07.2: the query projection with W^UK folded in gives the absorbed path's scores, bias included
        a, c = fold_query(mla.q_proj.weight, mla.q_proj.bias, mla.k_up.weight, config.n_heads)
        q_latent = torch.einsum("hcd,btd->bhtc", a, x) + c[:, None, :]  # (B, h, T, d_c)
        latents = mla.latent(x).unsqueeze(1)  # (B, 1, T, d_c)
        torch.testing.assert_close(q_latent @ latents.transpose(-2, -1), q @ k.transpose(-2, -1))


@pytest.mark.parametrize("exercise_id", ["07.1", "07.2", "07.3"])
def test_stub_is_not_solved(exercise_id):
    def stub(*args):
        raise NotImplementedError("not yet")

    assert grade(exercise_id, stub).status == "not solved yet"
