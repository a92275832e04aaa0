"""The chapter 07 exercise checks: a table of answers each check accepts and refuses (tests/exercise_table.py)."""
import math

import pytest
import torch
from exercise_table import Answers

from attnlib import GPTConfig
from attnlib.attention import MultiHeadAttention, MultiHeadLatentAttention
from attnlib.book.exercises import grade


# ---------------------------------------------------------------- 07.1
def _owner(n_heads, n_kv_heads):
    return torch.arange(n_heads) // (n_heads // n_kv_heads)  # query head -> its key/value head


def gqa_as_latent(w_k, w_v, n_heads, n_kv_heads):
    width, d_model = w_k.shape  # (n_kv * hd, d)
    hd = width // n_kv_heads
    kv_down = torch.cat([w_k, w_v])  # (2 n_kv hd, d): keys, then values
    pick = torch.eye(width, dtype=w_k.dtype).view(n_kv_heads, hd, width)[_owner(n_heads, n_kv_heads)]
    zero = torch.zeros(n_heads * hd, width, dtype=w_k.dtype)
    return kv_down, torch.cat([pick.reshape(-1, width), zero], 1), torch.cat([zero, pick.reshape(-1, width)], 1)


def gqa_as_latent_mixed(w_k, w_v, n_heads, n_kv_heads):  # any invertible mix of the latent is as good
    kv_down, k_up, v_up = gqa_as_latent(w_k, w_v, n_heads, n_kv_heads)
    d_c = kv_down.shape[0]
    mix = torch.eye(d_c, dtype=w_k.dtype) + 0.1 * torch.ones(d_c, d_c, dtype=w_k.dtype).triu(1)
    return mix @ kv_down, k_up @ torch.linalg.inv(mix), v_up @ torch.linalg.inv(mix)


def gqa_as_latent_values_first(w_k, w_v, n_heads, n_kv_heads):
    kv_down, k_up, v_up = gqa_as_latent(w_v, w_k, n_heads, n_kv_heads)
    return kv_down, v_up, k_up


def gqa_as_latent_tiled(w_k, w_v, n_heads, n_kv_heads):  # head i reads kv head i % n_kv
    width = w_k.shape[0]
    hd = width // n_kv_heads
    pick = torch.eye(width, dtype=w_k.dtype).view(n_kv_heads, hd, width).repeat(n_heads // n_kv_heads, 1, 1)
    zero = torch.zeros(n_heads * hd, width, dtype=w_k.dtype)
    return torch.cat([w_k, w_v]), torch.cat([pick.reshape(-1, width), zero], 1), \
        torch.cat([zero, pick.reshape(-1, width)], 1)


def gqa_as_latent_group_by_n_kv(w_k, w_v, n_heads, n_kv_heads):  # i // n_kv_heads: the group size confused
    width = w_k.shape[0]
    hd = width // n_kv_heads
    owner = (torch.arange(n_heads) // n_kv_heads).clamp(max=n_kv_heads - 1)
    pick = torch.eye(width, dtype=w_k.dtype).view(n_kv_heads, hd, width)[owner]
    zero = torch.zeros(n_heads * hd, width, dtype=w_k.dtype)
    return torch.cat([w_k, w_v]), torch.cat([pick.reshape(-1, width), zero], 1), \
        torch.cat([zero, pick.reshape(-1, width)], 1)


def gqa_as_latent_swapped(w_k, w_v, n_heads, n_kv_heads):
    kv_down, k_up, v_up = gqa_as_latent(w_k, w_v, n_heads, n_kv_heads)
    return kv_down, v_up, k_up


def gqa_as_latent_down_transposed(w_k, w_v, n_heads, n_kv_heads):
    kv_down, k_up, v_up = gqa_as_latent(w_k, w_v, n_heads, n_kv_heads)
    return kv_down.T, k_up, v_up


def gqa_as_latent_not_expanded(w_k, w_v, n_heads, n_kv_heads):  # one block per kv head, as GQA's cache
    width = w_k.shape[0]
    eye, zero = torch.eye(width, dtype=w_k.dtype), torch.zeros(width, width, dtype=w_k.dtype)
    return torch.cat([w_k, w_v]), torch.cat([eye, zero], 1), torch.cat([zero, eye], 1)


def gqa_as_latent_keys_only(w_k, w_v, n_heads, n_kv_heads):  # one latent for keys and values
    hd = w_k.shape[0] // n_kv_heads
    up = torch.eye(w_k.shape[0], dtype=w_k.dtype).view(n_kv_heads, hd, -1)[_owner(n_heads, n_kv_heads)]
    return w_k.clone(), up.reshape(n_heads * hd, -1), up.reshape(n_heads * hd, -1)


def gqa_as_latent_reordered(w_k, w_v, n_heads, n_kv_heads):
    kv_down, k_up, v_up = gqa_as_latent(w_k, w_v, n_heads, n_kv_heads)
    return k_up, v_up, kv_down


def gqa_as_latent_float32(w_k, w_v, n_heads, n_kv_heads):
    return tuple(t.float() for t in gqa_as_latent(w_k, w_v, n_heads, n_kv_heads))


def gqa_as_latent_wrong_values(w_k, w_v, n_heads, n_kv_heads):  # values from the first kv head only
    kv_down, k_up, v_up = gqa_as_latent(w_k, w_v, n_heads, n_kv_heads)
    hd = w_k.shape[0] // n_kv_heads
    return kv_down, k_up, v_up[:hd].repeat(n_heads, 1)


def gqa_as_latent_in_place(w_k, w_v, n_heads, n_kv_heads):
    out = gqa_as_latent(w_k, w_v, n_heads, n_kv_heads)
    w_k.zero_()
    return out


def test_07_1_the_latent_form_is_attnlibs_gqa():
    """The reference answer turns attnlib's GQA layer into an MLA layer with the same outputs."""
    torch.manual_seed(7)
    gqa = MultiHeadAttention(24, 6, 2, bias=False).double()
    mla = MultiHeadLatentAttention(24, 6, kv_latent_dim=2 * 2 * 4).double()
    w_k, w_v = gqa.qkv.weight[24:32], gqa.qkv.weight[32:]
    kv_down, k_up, v_up = gqa_as_latent(w_k.detach(), w_v.detach(), 6, 2)
    with torch.no_grad():
        mla.q_proj.weight.copy_(gqa.qkv.weight[:24])
        mla.q_proj.bias.zero_()
        mla.kv_down.weight.copy_(kv_down)
        mla.k_up.weight.copy_(k_up)
        mla.v_up.weight.copy_(v_up)
        mla.out_proj.weight.copy_(gqa.out_proj.weight)
        mla.out_proj.bias.zero_()
        x = torch.randn(2, 5, 24, dtype=torch.float64)
        torch.testing.assert_close(mla(x), gqa(x))


# ---------------------------------------------------------------- 07.2
def fold_query(q_weight, q_bias, w_uk, n_heads):
    d_c = w_uk.shape[1]
    w_q = q_weight.view(n_heads, -1, q_weight.shape[1])  # (h, hd, d): W^q_h
    b_q = q_bias.view(n_heads, -1)  # (h, hd)
    uk_t = w_uk.view(n_heads, -1, d_c).transpose(1, 2)  # (h, d_c, hd): W^UK_h^T
    return uk_t @ w_q, torch.einsum("hcd,hd->hc", uk_t, b_q)


def fold_query_einsum(q_weight, q_bias, w_uk, n_heads):  # per head, through einsum
    h = n_heads
    w_uk_h = w_uk.reshape(h, -1, w_uk.shape[1])  # (h, hd, d_c)
    a = torch.einsum("hkc,hkd->hcd", w_uk_h, q_weight.reshape(h, -1, q_weight.shape[1]))
    return a, torch.einsum("hkc,hk->hc", w_uk_h, q_bias.reshape(h, -1))


def fold_query_summed(q_weight, q_bias, w_uk, n_heads):
    a, c = fold_query(q_weight, q_bias, w_uk, n_heads)
    return a.sum(0), c


def fold_query_float32(q_weight, q_bias, w_uk, n_heads):
    a, c = fold_query(q_weight, q_bias, w_uk, n_heads)
    return a.float(), c.float()


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


def absorbed_decode_step_folded(layer, x_new, cache, rope):  # 07.2's fold of the whole query projection
    c, k_r = cache
    B, T = c.shape[:2]
    h, hd = layer.n_heads, layer.head_dim
    a, bias = fold_query(layer.q_proj.weight, layer.q_proj.bias, layer.k_up.weight, h)
    c = torch.cat([c, layer.kv_down(x_new)], dim=1)
    k_r = torch.cat([k_r, rope(layer.k_rope(x_new), torch.tensor([T]))], dim=1)
    q_latent = torch.einsum("hcd,btd->bhtc", a, x_new) + bias[:, None]  # (B, h, 1, d_c)
    q_rot = rope(layer.q_rope(x_new).view(B, 1, h, -1).transpose(1, 2), torch.tensor([T]))
    scores = (q_latent @ c.unsqueeze(1).transpose(-2, -1) + q_rot @ k_r.unsqueeze(1).transpose(-2, -1))
    weights = (scores / math.sqrt(hd + layer.rope_dim)).softmax(-1)
    y = torch.einsum("bhtc,hdc->bthd", weights @ c.unsqueeze(1), layer.v_up.weight.view(h, hd, -1))
    return layer.out_proj(y.reshape(B, 1, h * hd)), (c, k_r)


def decode_step_mutates_cache(layer, x_new, cache, rope):
    c, k_r = cache
    out, new = absorbed_decode_step(layer, x_new, cache, rope)
    if c.numel():
        c.mul_(1.0)
        c[0, 0, 0] += 1
    return out, new


def decode_step_returns_list(layer, x_new, cache, rope):
    out, (c, k_r) = absorbed_decode_step(layer, x_new, cache, rope)
    return out, [c, k_r]


ANSWERS = {
    "07.1": Answers(
        correct=[gqa_as_latent, gqa_as_latent_mixed, gqa_as_latent_values_first],
        wrong=[
            (gqa_as_latent_tiled, "i % n_kv_heads"),
            (gqa_as_latent_group_by_n_kv, "i // (n_heads // n_kv_heads)"),
            (gqa_as_latent_swapped, "swapped"),
            (gqa_as_latent_down_transposed, "kv_down is transposed"),
            (gqa_as_latent_not_expanded, "for every QUERY head"),
            (gqa_as_latent_keys_only, "AND value"),
            (gqa_as_latent_reordered, "in that order"),
            (gqa_as_latent_float32, "keep the dtype"),
            (gqa_as_latent_wrong_values, "the keys are right but not the values"),
            (gqa_as_latent_in_place, "in place"),
        ],
    ),
    "07.2": Answers(
        correct=[fold_query, fold_query_einsum],
        wrong=[
            (fold_query_no_bias, "the query bias is dropped"),
            (fold_query_transposed_shape, "W^UK is transposed"),
            (fold_query_reshaped_w_uk, "read with its axes swapped"),
            (fold_query_interleaved, "the heads are interleaved"),
            (fold_query_scaled, "with no scale"),
            (fold_query_in_place, "in place"),
            (fold_query_bias_unfolded, "split into heads but not folded"),
            (fold_query_summed, "the heads summed"),
            (fold_query_float32, "keep the dtype"),
        ],
    ),
    "07.3": Answers(
        correct=[absorbed_decode_step, absorbed_decode_step_folded],
        wrong=[
            (decode_step_scale_head_dim, "1/sqrt(head_dim + rope_dim)"),
            (decode_step_scale_latent, "the width of the absorbed vectors"),
            (decode_step_query_off_by_one, "positions count from 0"),
            (decode_step_key_unrotated, "cached unrotated"),
            (decode_step_no_rope, "rotary part is missing"),
            (decode_step_decoded_keys, "never compute k_up(cache)"),
            (decode_step_attends_before_appending, "does not attend to itself"),
            (decode_step_mutates_cache, "in place"),
            (decode_step_returns_list, "return a pair"),
        ],
    ),
}


def test_reference_answers_agree_with_the_library():
    """The exercises' references agree with the library's MLA and its layers' cache_width."""
    config = GPTConfig(d_model=24, n_heads=4, kv_latent_dim=10, n_layers=3, block_size=8, attention="mla")
    torch.manual_seed(3)
    mla = MultiHeadLatentAttention(24, 4, 10).eval()
    x = torch.randn(2, 6, config.d_model)
    with torch.no_grad():
        q, k, _ = mla.project(x)
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
