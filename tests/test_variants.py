"""Talking heads, MQA/GQA, chunked attention and MLA against independent references: torch's
nn.MultiheadAttention and the papers' formulas written out with explicit loops. Causality of every registry entry (alone and
inside the GPT) is tested in test_modules.py and test_gpt.py; bad inputs in test_bad_inputs.py.
"""
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode  # private, but stable across recent releases

from attnlib import GPT, GPTConfig, MultiHeadAttention
from attnlib.attention import (
    ATTENTION_FUNCTIONS,
    KV_SHARING,
    BiasedTalkingHeadsAttention,
    MultiHeadLatentAttention,
    TalkingHeadsAttention,
    mask_from_mod,
    padding_mask,
)
from attnlib.attention.mods import chunked
from attnlib.cache import ChunkedLayerCache, LayerCache
from attnlib.models.layers import ATTENTION_LAYERS, build_attention

ATOL = 1e-5


def leak(module, T=12, d_model=32, t=5):
    x = torch.randn(2, T, d_model)
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :])
    with torch.no_grad():
        return (module(x)[:, : t + 1] - module(x2)[:, : t + 1]).abs().max().item()


def config_for(name, **sizes):
    sizes = {"vocab_size": 11, "block_size": 8, "n_layers": 1, "n_heads": 4, "d_model": 16, **sizes}
    return GPTConfig(**sizes, attention=name, n_kv_heads=2 if name == "gqa" else None)


def test_registry_has_every_variant():
    assert set(ATTENTION_LAYERS) == {"mha", "talking_heads", "mqa", "gqa", "mla", "differential"}
    for name in ATTENTION_LAYERS:
        model = GPT(config_for(name))
        assert model(torch.randint(0, 11, (2, 8)))[0].shape == (2, 8, 11)


def torch_mha_like(d_model, n_heads, w_in, b_in, out_proj):
    """nn.MultiheadAttention with the given input projection [W_q; W_k; W_v] and output projection."""
    ref = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(w_in)
        ref.in_proj_bias.copy_(b_in)
        ref.out_proj.load_state_dict(out_proj.state_dict())
    return ref


def future(T):
    return torch.ones(T, T, dtype=torch.bool).triu(1)  # nn.MultiheadAttention's convention: True = may NOT attend


# ---------------------------------------------------------------- talking heads
def talking_heads_by_hand(layer, x):
    """Shazeer et al. 2020, Algorithm "TalkingHeadsAttention" (and eq. 2), causal, with explicit loops:

    J[n, m, h] = q[n, h] · k[m, h] / sqrt(d_k); J'[n, m, g] = sum_h J[n, m, h] P_l[h, g];
    W = softmax_m(J' + causal mask); W'[n, m, g] = sum_h W[n, m, h] P_w[h, g];
    O[n, g] = sum_m W'[n, m, g] v[m, g]; y = concat_g O[., g] W_o^T + b_o.
    Here P_l[h, g] = mix_logits[g, h] and P_w[h, g] = mix_weights[g, h] (the layer's matrices act on the left).
    """
    B, T, _ = x.shape
    H, d = layer.n_heads, layer.head_dim
    W, b = layer.qkv.weight, layer.qkv.bias
    P_l, P_w = layer.mix_logits.T, layer.mix_weights.T
    y = torch.zeros(B, T, layer.d_model, dtype=torch.float64)
    for bi in range(B):
        q = [[W[h * d : (h + 1) * d] @ x[bi, n] + b[h * d : (h + 1) * d] for h in range(H)] for n in range(T)]
        k = [[W[(H + h) * d : (H + h + 1) * d] @ x[bi, m] + b[(H + h) * d : (H + h + 1) * d] for h in range(H)] for m in range(T)]
        v = [[W[(2 * H + h) * d : (2 * H + h + 1) * d] @ x[bi, m] + b[(2 * H + h) * d : (2 * H + h + 1) * d] for h in range(H)] for m in range(T)]
        for n in range(T):
            J = [[float(q[n][h] @ k[m][h]) / math.sqrt(d) for h in range(H)] for m in range(T)]
            J2 = [[sum(J[m][h] * float(P_l[h, g]) for h in range(H)) for g in range(H)] for m in range(T)]
            weights = [[0.0] * H for _ in range(T)]  # weights[m][h] after the softmax over the visible keys m <= n
            for h in range(H):
                top = max(J2[m][h] for m in range(n + 1))
                e = [math.exp(J2[m][h] - top) for m in range(n + 1)]
                for m in range(n + 1):
                    weights[m][h] = e[m] / sum(e)
            W2 = [[sum(weights[m][h] * float(P_w[h, g]) for h in range(H)) for g in range(H)] for m in range(T)]
            heads = [sum(W2[m][g] * v[m][g].double() for m in range(T)) for g in range(H)]
            y[bi, n] = layer.out_proj.weight.double() @ torch.cat(heads) + layer.out_proj.bias.double()
    return y


def test_talking_heads_equals_the_papers_formula_written_out():
    torch.manual_seed(0)
    layer = TalkingHeadsAttention(8, 2, block_size=5).double()
    with torch.no_grad():
        layer.mix_logits.copy_(torch.randn(2, 2))
        layer.mix_weights.copy_(torch.randn(2, 2))
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), talking_heads_by_hand(layer, x))


def test_biased_talking_heads_leaks_and_ours_does_not():
    torch.manual_seed(0)
    assert leak(TalkingHeadsAttention(32, 4).eval()) <= 1e-6
    assert leak(BiasedTalkingHeadsAttention(32, 4).eval()) > 1e-3


def test_biased_talking_heads_puts_weight_on_future_keys():
    module = BiasedTalkingHeadsAttention(32, 4).eval()
    _, weights = module(torch.randn(1, 6, 32), return_weights=True)
    assert (weights[..., future(6)] != 0).all()


def test_talking_heads_with_identity_mixing_equals_torch_multihead_attention():
    th = TalkingHeadsAttention(32, 4)
    ref = torch_mha_like(32, 4, th.qkv.weight, th.qkv.bias, th.out_proj)
    x = torch.randn(2, 12, 32)
    torch.testing.assert_close(th(x), ref(x, x, x, attn_mask=future(12), need_weights=False)[0], atol=ATOL, rtol=0)


def test_talking_heads_mixes_heads_and_stays_finite_on_empty_rows():
    th = TalkingHeadsAttention(32, 4)
    with torch.no_grad():
        th.mix_logits.copy_(torch.randn(4, 4))
        th.mix_weights.copy_(torch.randn(4, 4))
    x = torch.randn(2, 6, 32, requires_grad=True)
    real = padding_mask(torch.tensor([0, 4]), 6)  # sequence 0 has no keys at all
    y, weights = th(x, attention_mask=real, return_weights=True)
    assert torch.isfinite(y).all() and torch.isfinite(weights).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(th.mix_logits.grad).all()
    assert torch.equal(weights[0], torch.zeros_like(weights[0]))
    assert torch.equal(weights[1, ..., 4:], torch.zeros(4, 6, 2))  # padded keys stay at 0 after mixing
    assert leak(th.eval()) <= 1e-6  # causal with any mixing matrices


# ---------------------------------------------------------------- MHA / GQA / MQA
def grouped_by_hand(layer, x, real=None, visible=None):
    """Causal grouped-query attention (Ainslie et al. 2023), one query head at a time: query head h
    reads key/value head h // (n_heads / n_kv_heads); the rows of qkv are [W_q; W_k; W_v]. ``visible``:
    a (T, T) or (B, T, T) mask to use instead of the causal one."""
    H, G, d = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q, k, v = layer.qkv(x).split([H * d, G * d, G * d], dim=-1)
    T = x.shape[1]
    visible = torch.ones(T, T, dtype=torch.bool).tril() if visible is None else visible
    if real is not None:
        visible = visible & real[:, None, :]  # (B, T, T)
    heads = []
    for h in range(H):
        g = h // (H // G)
        qh, kh, vh = q[..., h * d : (h + 1) * d], k[..., g * d : (g + 1) * d], v[..., g * d : (g + 1) * d]
        scores = (qh @ kh.transpose(-1, -2) / math.sqrt(d)).masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores.masked_fill(~visible.any(-1, keepdim=True), 0.0), -1) * visible  # empty rows: 0
        heads.append(weights @ vh)
    return layer.out_proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("kv_sharing", KV_SHARING)
@pytest.mark.parametrize("attn_fn", list(ATTENTION_FUNCTIONS))
def test_gqa_with_as_many_kv_heads_as_heads_equals_torch_mha(kv_sharing, attn_fn):
    gqa = MultiHeadAttention(32, 4, n_kv_heads=4, attn_fn=attn_fn, kv_sharing=kv_sharing)
    ref = torch_mha_like(32, 4, gqa.qkv.weight, gqa.qkv.bias, gqa.out_proj)  # the same layout: [W_q; W_k; W_v]
    x = torch.randn(2, 12, 32)
    torch.testing.assert_close(gqa(x), ref(x, x, x, attn_mask=future(12), need_weights=False)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kv_sharing", KV_SHARING)
@pytest.mark.parametrize("attn_fn", list(ATTENTION_FUNCTIONS))
@pytest.mark.parametrize("n_kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_grouped_heads_equal_the_per_head_loop(n_kv_heads, attn_fn, kv_sharing):
    layer = MultiHeadAttention(32, 4, n_kv_heads, attn_fn=attn_fn, kv_sharing=kv_sharing)
    x = torch.randn(3, 10, 32)
    real = padding_mask([10, 6, 1], 10)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), grouped_by_hand(layer, x), atol=ATOL, rtol=0)
        torch.testing.assert_close(layer(x, attention_mask=real), grouped_by_hand(layer, x, real), atol=ATOL, rtol=0)


def test_mqa_is_one_kv_head():
    mqa = build_attention(GPTConfig(d_model=32, n_heads=4, block_size=12, attention="mqa"), 0)
    assert mqa.n_kv_heads == 1 and mqa.qkv.out_features == 32 + 2 * 8 and mqa.cache_width == 2 * 8
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        torch.testing.assert_close(mqa(x), grouped_by_hand(mqa, x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_kv_sharings_agree_with_per_head_masks_and_weights(n_kv_heads):
    modules = {name: MultiHeadAttention(32, 4, n_kv_heads, kv_sharing=name) for name in KV_SHARING}
    modules["repeat_interleave"].load_state_dict(modules["fold"].state_dict())
    x = torch.randn(3, 12, 32)
    head_mask = torch.rand(3, 4, 12, 12) < 0.8
    for mask in (None, head_mask):
        torch.testing.assert_close(modules["fold"](x, mask=mask), modules["repeat_interleave"](x, mask=mask), atol=ATOL, rtol=0)
    _, w = modules["fold"](x, return_weights=True)
    _, w_ref = modules["repeat_interleave"](x, return_weights=True)
    torch.testing.assert_close(w, w_ref, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- chunked attention (Llama 4)
def chunk_loop(T, chunk_size, real=None):
    """Query i sees key j iff j <= i and i // C == j // C, written as a loop; with a padding mask ``real``
    (B, T), positions count from each row's first real token and padded keys are never seen."""
    rows = [None] if real is None else range(real.shape[0])
    masks = []
    for b in rows:
        if b is None:
            pos = list(range(T))
        else:
            pos, seen = [], 0
            for t in range(T):
                pos.append(max(seen - 1 + int(real[b, t]), 0))
                seen += int(real[b, t])
        mask = torch.zeros(T, T, dtype=torch.bool)
        for i in range(T):
            for j in range(T):
                mask[i, j] = j <= i and pos[j] <= pos[i] and pos[i] // chunk_size == pos[j] // chunk_size
                if b is not None:
                    mask[i, j] &= bool(real[b, j])
        masks.append(mask)
    return masks[0] if real is None else torch.stack(masks)


@pytest.mark.parametrize("attn_fn", list(ATTENTION_FUNCTIONS))
@pytest.mark.parametrize(("chunk_size", "n_kv_heads"), [(1, 2), (3, 2), (4, 1), (5, 4), (20, 2)])
def test_chunked_layer_equals_the_loop_and_the_mask_mod(chunk_size, n_kv_heads, attn_fn):
    layer = MultiHeadAttention(32, 4, n_kv_heads, chunk_size=chunk_size, attn_fn=attn_fn)
    plain = MultiHeadAttention(32, 4, n_kv_heads, attn_fn=attn_fn)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 10, 32)
    expected = chunk_loop(10, chunk_size)
    assert torch.equal(mask_from_mod(chunked(chunk_size), (1, 1, 10, 10))[0, 0], expected)
    with torch.no_grad():
        y = layer(x)
        torch.testing.assert_close(y, grouped_by_hand(layer, x, visible=expected), atol=ATOL, rtol=0)
        torch.testing.assert_close(y, plain(x, mask=expected[None, None]), atol=ATOL, rtol=0)
    if chunk_size == 1:  # each token sees only itself: the output is its own value, projected
        _, _, v = layer.project(x)
        torch.testing.assert_close(y, layer.merge(v.repeat_interleave(4 // n_kv_heads, 1)), atol=ATOL, rtol=0)


def test_chunked_layer_with_left_padding_counts_chunks_from_the_first_real_token():
    layer = MultiHeadAttention(32, 4, 2, chunk_size=3)
    x = torch.randn(3, 9, 32)
    real = torch.ones(3, 9, dtype=torch.bool)
    real[1, :2] = False  # two pads on the left
    real[2, :4] = False
    with torch.no_grad():
        y = layer(x, attention_mask=real)
        expected = grouped_by_hand(layer, x, visible=chunk_loop(9, 3, real))
    torch.testing.assert_close(y[real], expected[real], atol=ATOL, rtol=0)  # pads' outputs are never read
    # a padded row's real tokens give what the unpadded sequence gives
    torch.testing.assert_close(y[2, 4:], layer(x[2:, 4:])[0].detach(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("steps", [(10,), (4, 3, 1, 1, 1), (1,) * 10, (2, 5, 3)])
def test_chunked_layer_decodes_through_its_cache_like_the_whole_sequence(steps):
    """Cached ≡ uncached: the layer's own cache keeps only the current chunk; the contiguous cache keeps all."""
    layer = MultiHeadAttention(32, 4, 2, chunk_size=4, block_size=10).eval()
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        full = layer(x)
        for cache in (layer.new_cache(10), LayerCache(10)):
            pieces, start = [], 0
            for n in steps:
                pieces.append(layer(x[:, start : start + n], cache=cache))
                start += n
            torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=ATOL, rtol=0, msg=type(cache).__name__)
    assert isinstance(layer.new_cache(10), ChunkedLayerCache)


class NewStorageBytes(TorchDispatchMode):
    """Adds up the bytes of every new storage the operations inside allocate."""

    def __init__(self, *known):
        super().__init__()
        self.seen = {t.untyped_storage().data_ptr() for t in known}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                self.seen.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize(
    "kv_sharing, attn_fn, copies",
    [("fold", "sdpa", False), ("fold", "eager", False), ("repeat_interleave", "sdpa", True)],
)
def test_which_kv_sharings_copy_the_shared_heads(kv_sharing, attn_fn, copies):
    """A decoding step (one query per head, a long cache): copying K/V dwarfs everything else it allocates."""
    with torch.device("meta"):
        layer = MultiHeadAttention(2048, 16, 2, block_size=1024, kv_sharing=kv_sharing, attn_fn=attn_fn)
    q = torch.randn(2, 16, 1, 128)  # (B, n_heads, 1, head_dim): one new token
    k, v = torch.randn(2, 2, 1024, 128), torch.randn(2, 2, 1024, 128)  # (B, n_kv_heads, T_k, head_dim)
    with NewStorageBytes(q, k, v) as log:
        layer.attend(q, k, v, None, False, False)
    kv_bytes = k.untyped_storage().nbytes() + v.untyped_storage().nbytes()
    assert (log.bytes >= 8 * kv_bytes) if copies else (log.bytes < kv_bytes / 4), log.bytes


# ---------------------------------------------------------------- MLA
def mla_as_torch_mha(mla):
    """nn.MultiheadAttention whose key/value weights are the composed W_UK·W_DKV and W_UV·W_DKV (no K/V bias)."""
    with torch.no_grad():
        w_k = mla.k_up.weight @ mla.kv_down.weight  # (d_model, d_c) @ (d_c, d_model)
        w_v = mla.v_up.weight @ mla.kv_down.weight
        w_in = torch.cat([mla.q_proj.weight, w_k, w_v])
        b_in = torch.cat([mla.q_proj.bias, torch.zeros(2 * mla.d_model)])
    return torch_mha_like(mla.d_model, mla.n_heads, w_in, b_in, mla.out_proj)


@pytest.mark.parametrize("absorb", [False, True], ids=["naive", "absorbed"])
@pytest.mark.parametrize("attn_fn", list(ATTENTION_FUNCTIONS))
def test_mla_equals_mha_with_composed_key_value_weights(absorb, attn_fn):
    mla = MultiHeadLatentAttention(32, 4, 8, attn_fn=attn_fn, absorb=absorb)
    ref = mla_as_torch_mha(mla)
    x = torch.randn(2, 12, 32)
    real = padding_mask([12, 5], 12)
    with torch.no_grad():
        expected, _ = ref(x, x, x, attn_mask=future(12), need_weights=False)
        torch.testing.assert_close(mla(x), expected, atol=ATOL, rtol=0)
        expected, _ = ref(x, x, x, attn_mask=future(12), key_padding_mask=~real, need_weights=False)
        torch.testing.assert_close(mla(x, attention_mask=real), expected, atol=ATOL, rtol=0)


def test_mla_cross_attention_equals_torch_with_composed_weights():
    mla = MultiHeadLatentAttention(32, 4, 8, causal=False, absorb=True)
    ref = mla_as_torch_mha(mla)
    x, context = torch.randn(2, 5, 32), torch.randn(2, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(mla(x, context), ref(x, context, context, need_weights=False)[0], atol=ATOL, rtol=0)


def test_mla_absorbed_equals_naive():
    naive = MultiHeadLatentAttention(32, 4, 8)
    absorbed = MultiHeadLatentAttention(32, 4, 8, absorb=True)
    absorbed.load_state_dict(naive.state_dict())
    x = torch.randn(2, 12, 32)
    torch.testing.assert_close(absorbed(x), naive(x), atol=ATOL, rtol=0)
    real = padding_mask(torch.tensor([12, 5]), 12)
    torch.testing.assert_close(absorbed(x, attention_mask=real), naive(x, attention_mask=real), atol=ATOL, rtol=0)
    _, w_naive = naive(x, return_weights=True)
    _, w_absorbed = absorbed(x, return_weights=True)
    torch.testing.assert_close(w_absorbed, w_naive, atol=ATOL, rtol=0)


def test_mla_absorbed_equals_naive_in_the_gpt():
    config = GPTConfig(vocab_size=13, block_size=10, n_layers=2, n_heads=4, d_model=32, kv_latent_dim=8, attention="mla")
    model = GPT(config).eval()
    idx = torch.randint(0, 13, (2, 10))
    naive, _ = model(idx)
    for block in model.blocks:
        block.attn.absorb = True
    torch.testing.assert_close(model(idx)[0], naive, atol=ATOL, rtol=0)


def test_mla_keys_and_values_come_from_the_latent():
    mla = MultiHeadLatentAttention(32, 4, 8)
    x = torch.randn(1, 5, 32)
    c = mla.latent(x)
    assert c.shape == (1, 5, 8)
    _, k, v = mla.project(x)
    torch.testing.assert_close(k, (c @ mla.k_up.weight.T).view(1, 5, 4, 8).transpose(1, 2))
    torch.testing.assert_close(v, (c @ mla.v_up.weight.T).view(1, 5, 4, 8).transpose(1, 2))


# ---------------------------------------------------------------- cache widths
def test_cache_widths_follow_deepseek_v2_table_1():
    """Per token and layer: MHA 2·n_h·d_h, GQA 2·n_g·d_h, MQA 2·d_h, MLA d_c (without RoPE's d_h^R)."""
    n_h, d_h, n_g, d_c = 4, 16, 2, 16
    expected = {"mha": 2 * n_h * d_h, "talking_heads": 2 * n_h * d_h, "gqa": 2 * n_g * d_h, "mqa": 2 * d_h, "mla": d_c}
    for name, width in expected.items():
        config = GPTConfig(d_model=64, n_heads=4, attention=name, n_kv_heads=n_g if name == "gqa" else None,
                           kv_latent_dim=d_c if name == "mla" else None)
        layer = build_attention(config, 0)
        assert layer.cache_width == width, name
        assert layer.cache_bytes_per_token(torch.bfloat16) == 2 * width
    # ... and they are the widths of what each layer produces per token
    x = torch.randn(1, 3, 64)
    _, k, v = MultiHeadAttention(64, 4, n_g).project(x)
    assert k[0, :, 0].numel() + v[0, :, 0].numel() == expected["gqa"]
    assert MultiHeadLatentAttention(64, 4, d_c).latent(x)[0, 0].numel() == expected["mla"]


def test_talking_heads_and_mla_take_what_they_use_and_refuse_the_rest():
    """Options equal to what the variant always uses are accepted; another value is refused, naming both."""
    from attnlib.attention import MultiHeadLatentAttention, TalkingHeadsAttention

    TalkingHeadsAttention(16, 4, attn_fn="eager", n_kv_heads=4, kv_sharing="fold", head_dim=4, qk_norm=False)
    MultiHeadLatentAttention(16, 4, 8, n_kv_heads=4, head_dim=4)
    with pytest.raises(ValueError, match=r"does not take \['attn_fn'\]: attn_fn='sdpa' \(it uses attn_fn='eager'\)"):
        TalkingHeadsAttention(16, 4, attn_fn="sdpa")
    with pytest.raises(ValueError, match=r"does not take \['n_kv_heads'\]: n_kv_heads=2 \(it uses n_kv_heads=4\)"):
        MultiHeadLatentAttention(16, 4, 8, n_kv_heads=2)
    with pytest.raises(ValueError, match=r"n_heads=0 must be a positive integer"):
        TalkingHeadsAttention(16, 0)


def test_a_decoding_step_builds_no_graph():
    from attnlib import GPT, GPTConfig
    from attnlib.generation import step, window_step

    model = GPT(GPTConfig())
    tokens = torch.randint(0, 65, (1, 5))
    assert not step(model, tokens).requires_grad
    logits, _ = window_step(model, tokens, model.new_cache(), 5)
    assert not logits.requires_grad
