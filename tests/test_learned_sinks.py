"""Learned attention sinks (gpt-oss, transformers' ``s_aux``; chapter 20) in every attention function.

One logit per query head joins each row's softmax denominator and is dropped. Not StreamingLLM's sink
*tokens* (``tests/test_sinks.py``: a windowed cache that keeps the first keys). Compared here, in float32
within 1e-5: eager ≡ tiled ≡ flash ≡ a plain formula written below (float64, no max subtracted, no
library code) ≡ transformers' gpt-oss ``eager_attention_forward``; outputs and gradients, the sinks'
own included, with masks, causality, grouped-query heads, windows and empty rows.
"""
from __future__ import annotations

import types

import pytest
import torch

from attnlib import DecoderConfig
from attnlib.attention import MultiHeadAttention, attention, flash_attention, sdpa_attention, tiled_attention
from attnlib.attention.masks import mask_from_mod
from attnlib.attention.mods import chunked, sliding_window
from attnlib.models.decoder import Decoder

TOL = 1e-5
FUNCTIONS = {"eager": attention,
             "tiled": lambda *a, **kw: tiled_attention(*a, tile_size=3, **kw),
             "flash": lambda *a, **kw: flash_attention(*a, tile_size=3, **kw)}


def plain(q, k, v, keep, sinks, scale):
    """softmax with exp(sink) in its denominator, written out in float64: (output, weights, p_sink)."""
    q, k, v, sinks = q.double(), k.double(), v.double(), sinks.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # one K/V head per query head
    e = torch.exp(torch.einsum("bhqd,bhkd->bhqk", q, k) * scale)
    if keep is not None:
        e = e * keep  # a hidden key adds nothing to the numerator or the denominator
    denom = e.sum(dim=-1, keepdim=True) + torch.exp(sinks)[None, :, None, None]
    return torch.einsum("bhqk,bhkd->bhqd", e / denom, v), e / denom, torch.exp(sinks)[None, :, None, None] / denom


def inputs(B=2, H=4, n_kv=2, T_q=7, T_k=9, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, T, d, generator=g) for n, T in ((H, T_q), (n_kv, T_k), (n_kv, T_k)))
    return q, k, v, torch.randn(H, generator=g) * 2


def keep_mask(case: str, B, T_q, T_k):
    """(mask passed to the function, is_causal, the bool mask it means (B|1, 1|H, T_q, T_k) or None)."""
    causal = torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q)
    if case == "none":
        return None, False, None
    if case == "causal":
        return None, True, causal
    if case == "window":
        m = mask_from_mod(sliding_window(3), (1, 1, T_q, T_k))
        return m, False, m
    if case == "chunk":
        m = mask_from_mod(chunked(4), (1, 1, T_q, T_k))
        return m, True, m & causal
    m = torch.rand(B, 1, T_q, T_k, generator=torch.Generator().manual_seed(5)) > 0.4  # "padding+empty"
    m[0, 0, 2] = False  # a row with nothing to attend to: the sink takes all of it
    return m, True, m & causal


CASES = ["none", "causal", "window", "chunk", "random+empty"]


def run(fn, q, k, v, sinks, mask, is_causal, g):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = fn(*leaves[:3], mask, is_causal=is_causal, sinks=leaves[3])[0]
    out.backward(g)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_functions_equal_the_plain_formula_outputs_and_gradients(case, n_kv):
    q, k, v, sinks = inputs(n_kv=n_kv)
    mask, is_causal, keep = keep_mask(case, 2, 7, 9)
    g = torch.randn(2, 4, 7, 8, generator=torch.Generator().manual_seed(9))
    leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    ref = plain(*leaves[:3], keep, leaves[3], 8**-0.5)[0]
    ref.backward(g.double())
    expected = [ref.detach()] + [t.grad for t in leaves]
    assert expected[4].abs().min() > 1e-3  # each head's sink has a gradient to compare
    for name, fn in FUNCTIONS.items():
        got = run(fn, q, k, v, sinks, mask, is_causal, g)
        for what, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected):
            assert not torch.isnan(a).any(), (name, what)
            assert (a.double() - b).abs().max() < TOL, (name, what, (a.double() - b).abs().max().item())


@pytest.mark.parametrize("case", CASES)
def test_eager_equals_transformers_gpt_oss_eager_attention(case):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, sinks = inputs(T_q=9)  # transformers' masks are square here: prefill
    mask, is_causal, keep = keep_mask(case, 2, 9, 9)
    additive = None if keep is None else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    module = types.SimpleNamespace(num_key_value_groups=2, sinks=leaves[3], training=False)
    ref, ref_weights = eager_attention_forward(module, *leaves[:3], additive, scaling=8**-0.5)
    g = torch.randn(2, 9, 4, 8, generator=torch.Generator().manual_seed(9))  # theirs is (B, T, H, d)
    ref.backward(g)
    got = run(attention, q, k, v, sinks, mask, is_causal, g.transpose(1, 2))
    out, weights = attention(q, k, v, mask, is_causal=is_causal, sinks=sinks)
    assert (got[0] - ref.detach().transpose(1, 2)).abs().max() < TOL
    assert (weights - ref_weights.detach()).abs().max() < TOL
    for a, t in zip(got[1:], leaves):
        assert (a - t.grad).abs().max() < TOL


def test_eager_weights_leave_the_sink_its_share():
    q, k, v, sinks = inputs()
    mask, _, keep = keep_mask("random+empty", 2, 7, 9)
    weights = attention(q, k, v, mask, is_causal=True, sinks=sinks)[1]
    _, ref_weights, p_sink = plain(q, k, v, keep, sinks, 8**-0.5)
    assert (weights.double() - ref_weights).abs().max() < TOL
    assert (weights.sum(-1).double() + p_sink.squeeze(-1) - 1).abs().max() < TOL  # rows sum to 1 - p_sink < 1
    assert (weights.sum(-1) < 1).all()


@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_row_with_no_key_gives_the_sink_everything(name):
    q, k, v, sinks = inputs()
    mask = torch.ones(2, 1, 7, 9, dtype=torch.bool)
    mask[1, :, 4] = False
    got = run(FUNCTIONS[name], q, k, v, sinks, mask, False, torch.ones(2, 4, 7, 8))
    assert all(torch.isfinite(t).all() for t in got)
    assert torch.equal(got[0][1, :, 4], torch.zeros(4, 8))  # output 0: the sink's value is nothing
    assert torch.equal(got[1][1, :, 4], torch.zeros(4, 8))  # and the row's query gets no gradient


def test_flash_sink_gradient_is_minus_p_sink_times_D():
    """d sink_h = -Σ_(b,i) p_sink(b,h,i) · (dO · O)(b,h,i): the formula flash's backward uses, checked by hand."""
    q, k, v, sinks = inputs()
    g = torch.randn(2, 4, 7, 8, generator=torch.Generator().manual_seed(9))
    got = run(FUNCTIONS["flash"], q, k, v, sinks, None, True, g)
    out, _, p_sink = plain(q, k, v, torch.ones(7, 9, dtype=torch.bool).tril(2), sinks, 8**-0.5)
    by_hand = -(p_sink.squeeze(-1) * (g.double() * out).sum(-1)).sum(dim=(0, 2))
    assert (got[4].double() - by_hand).abs().max() < TOL


def test_sinks_change_the_result_and_a_very_negative_sink_is_none():
    q, k, v, sinks = inputs()
    without = attention(q, k, v, is_causal=True)[0]
    assert (attention(q, k, v, is_causal=True, sinks=sinks)[0] - without).abs().max() > 1e-2
    for fn in FUNCTIONS.values():
        assert (fn(q, k, v, is_causal=True, sinks=torch.full((4,), -200.0))[0] - without).abs().max() < TOL


def test_half_precision_and_a_sink_of_another_dtype():
    q, k, v, sinks = inputs()
    ref = attention(q, k, v, is_causal=True, sinks=sinks)[0]
    for name, fn in FUNCTIONS.items():
        out = fn(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, sinks=sinks)[0]  # float32 sinks, cast
        assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() < 5e-2, name
        assert (fn(q, k, v, is_causal=True, sinks=sinks.double())[0] - ref).abs().max() < TOL, name


@pytest.mark.parametrize("fn", [attention, sdpa_attention, tiled_attention, flash_attention],
                         ids=["eager", "sdpa", "tiled", "flash"])
@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda s: s.long(), TypeError, "sinks must be a floating point tensor .one logit per head.; got dtype torch.int64"),
        (lambda s: s.tolist(), TypeError, r"sinks must be a floating point torch.Tensor \(n_heads,\) or None; got list"),
        (lambda s: s[:2], ValueError, r"sinks must have shape \(n_heads,\) = \(4,\), one logit per query head; got \(2,\)"),
        (lambda s: s[None], ValueError, r"sinks must have shape \(n_heads,\) = \(4,\), one logit per query head; got \(1, 4\)"),
        (lambda s: s.to("meta"), ValueError, "sinks is on meta but q on cpu"),
    ],
)
def test_bad_sinks_are_refused_before_any_kernel(fn, make, error, match):
    q, k, v, sinks = inputs()
    with pytest.raises(error, match=match):
        fn(q, k, v, is_causal=True, sinks=make(sinks))


def test_sinks_need_named_heads_and_sdpa_cannot_add_them():
    q, k, v, sinks = inputs(n_kv=4)
    with pytest.raises(ValueError, match=r"sinks need 4-D q \(B, n_heads, T_q, head_dim\) to name the heads; got q \(8, 7, 8\)"):
        attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), sinks=sinks)
    with pytest.raises(ValueError, match="sdpa_attention cannot add sinks to its softmax's denominator"):
        sdpa_attention(q, k, v, sinks=sinks)


# ---------------------------------------------------------------- the layer and the decoder


def layer(attn_fn="eager", **kw):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, 2, attn_fn=attn_fn, sinks=True, **kw)
    with torch.no_grad():
        m.sinks.normal_(0.0, 2.0)
    return m


@pytest.mark.parametrize("kw", [{}, dict(sliding_window=3), dict(chunk_size=4)], ids=["full", "window", "chunk"])
def test_layer_functions_agree_and_cached_decode_equals_uncached(kw):
    from attnlib.positional import RotaryEmbedding

    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(1))
    rope = RotaryEmbedding(8, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
    eager = layer(rope=rope, **kw)
    assert tuple(eager.sinks.shape) == (4,) and "sinks" in dict(eager.named_parameters())
    full = eager(x)
    for attn_fn, sharing in (("tiled", "fold"), ("flash", "fold"), ("eager", "repeat_interleave")):
        other = layer(attn_fn, rope=rope, kv_sharing=sharing, **kw)
        other.load_state_dict(eager.state_dict())
        assert (other(x) - full).abs().max() < TOL
    cache = eager.new_cache(16)
    steps = [eager(x[:, :4], cache=cache)] + [eager(x[:, t : t + 1], cache=cache) for t in range(4, 10)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < TOL
    out, weights = eager(x, return_weights=True)
    assert torch.equal(out, full) and (weights.sum(-1) < 1).all()
    bare = MultiHeadAttention(32, 4, 2, attn_fn="eager", rope=rope, **kw)
    bare.load_state_dict({k: t for k, t in eager.state_dict().items() if k != "sinks"})
    assert (bare(x) - full).abs().max() > 1e-3  # the sinks matter


def test_layer_refuses_sinks_with_sdpa_and_a_non_bool():
    with pytest.raises(ValueError, match=r"sinks=True needs attn_fn='eager', 'tiled' or 'flash' \('sdpa' cannot"):
        MultiHeadAttention(32, 4, sinks=True)
    with pytest.raises(TypeError, match="sinks must be a bool; got 1"):
        MultiHeadAttention(32, 4, attn_fn="eager", sinks=1)
    assert MultiHeadAttention(32, 4).sinks is None


def test_decoder_config_attention_sinks():
    fields = dict(vocab_size=11, block_size=16, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                  layer_types=("sliding_attention", "full_attention"), sliding_window=3, attention_sinks=True)
    config = DecoderConfig.llama(**fields)
    assert config.attn_fn == "eager"  # derived: SDPA cannot add the sink
    assert DecoderConfig.llama(**{**fields, "attention_sinks": False}).attn_fn == "sdpa"
    model = Decoder(config.replace(attn_fn="flash")).eval()
    assert all(tuple(block.attn.sinks.shape) == (4,) for block in model.blocks)
    idx = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)[0]
        cache = model.new_cache()
        steps = [model(idx[:, :5], cache=cache)[0]] + [model(idx[:, t : t + 1], cache=cache)[0] for t in range(5, 9)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < TOL
    with pytest.raises(ValueError, match="attention_sinks=True cannot run with attn_fn='sdpa'"):
        DecoderConfig.llama(**fields, attn_fn="sdpa")
    with pytest.raises(ValueError, match="attention_sinks=True applies to attention='mha', 'gqa' or 'mqa'; got 'mla'"):
        DecoderConfig(vocab_size=11, n_heads=4, d_model=32, attention="mla", attention_sinks=True)
    with pytest.raises(TypeError, match="attention_sinks must be a bool; got 'yes'"):
        DecoderConfig(attention_sinks="yes")
