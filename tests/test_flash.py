"""flash_attention (FlashAttention's forward and backward by blocks) against torch's SDPA, gradcheck and a memory count.

``flash_attention`` has the registry's signature (``ATTENTION_FUNCTIONS["flash"]``) and returns ``(output, None)``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlib.attention import ATTENTION_FUNCTIONS, MultiHeadAttention, attention, causal_mask, flash_attention
from attnlib.attention.flash import FlashAttentionFunction
from attnlib.attention.mods import alibi, softcap

TOL = dict(atol=1e-5, rtol=1e-5)


def qkv(B, H, T_q, T_k, d, n_kv=None, d_v=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T_q, d, generator=g, dtype=dtype)
    k = torch.randn(B, n_kv or H, T_k, d, generator=g, dtype=dtype)
    v = torch.randn(B, n_kv or H, T_k, d_v or d, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def sdpa(q, k, v, is_causal=False, scale=None):
    """The reference: torch's SDPA, with the bottom-right causal mask passed explicitly when T_q != T_k."""
    mask = causal_mask(q.shape[-2], k.shape[-2]) if is_causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def flash_out(q, k, v, mask=None, **kwargs):
    """flash_attention's output; its second result must be None (it keeps no weights)."""
    out, weights = flash_attention(q, k, v, mask, **kwargs)
    assert weights is None
    return out


def output_and_grads(fn, q, k, v, d_out):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), d_out))


SHAPES = [  # (T_q, T_k, tile_size, scale)
    (64, 64, 16, None),  # whole tiles
    (37, 37, 16, None),  # odd lengths, a partial last tile
    (50, 50, 7, 0.3),  # a tile size that divides nothing; scale given
    (50, 50, 1, None),  # one query and one key per block
    (50, 50, 128, None),  # one tile holds everything
    (13, 45, 8, None),  # T_q < T_k (a cached decode's queries are the last positions)
    (1, 33, 4, 1.0),  # a single new query
    (45, 13, 8, None),  # T_q > T_k: non-causal only (causal needs T_q <= T_k, a bad input below)
]


@pytest.mark.parametrize(
    ("T_q", "T_k", "tile_size", "scale", "is_causal"),
    [(*shape, causal) for shape in SHAPES for causal in (False, True) if not (causal and shape[0] > shape[1])],
)
def test_output_and_gradients_equal_sdpa(T_q, T_k, tile_size, scale, is_causal):
    q, k, v = qkv(2, 3, T_q, T_k, 16, d_v=24)
    d_out = torch.randn(2, 3, T_q, 24, generator=torch.Generator().manual_seed(1))
    got = output_and_grads(lambda q, k, v: flash_out(q, k, v, is_causal=is_causal, scale=scale, tile_size=tile_size), q, k, v, d_out)
    want = output_and_grads(lambda q, k, v: sdpa(q, k, v, is_causal, scale), q, k, v, d_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("is_causal", [False, True])
def test_grouped_query_heads_equal_sdpa_with_enable_gqa(is_causal):
    q, k, v = qkv(2, 6, 29, 29, 8, n_kv=2)
    d_out = torch.randn(2, 6, 29, 8, generator=torch.Generator().manual_seed(3))
    got = output_and_grads(lambda q, k, v: flash_out(q, k, v, is_causal=is_causal, tile_size=8), q, k, v, d_out)
    want = output_and_grads(lambda q, k, v: sdpa(q, k, v, is_causal), q, k, v, d_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    assert got[2].shape == k.shape  # dK sums the three query heads that read each K/V head


def test_three_dim_inputs_equal_sdpa():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 21, 8, generator=g, requires_grad=True) for _ in range(3))
    d_out = torch.randn(3, 21, 8, generator=g)
    got = output_and_grads(lambda q, k, v: flash_out(q, k, v, is_causal=True, tile_size=5), q, k, v, d_out)
    want = output_and_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, d_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize(
    ("T_q", "T_k", "n_kv", "is_causal", "tile_size"),
    [(5, 5, 2, False, 2), (5, 5, 2, True, 2), (3, 7, 1, True, 3), (7, 4, 2, False, 3)],
)
def test_gradcheck_float64(T_q, T_k, n_kv, is_causal, tile_size):
    q, k, v = qkv(1, 2, T_q, T_k, 3, n_kv=n_kv, d_v=2, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_out(q, k, v, is_causal=is_causal, scale=0.7, tile_size=tile_size), (q, k, v)
    )


def test_rows_that_see_nothing_give_zeros_not_nan():
    # Query 1 of batch 0 may see no key: its output and every gradient through it are 0, as with
    # attnlib's eager attention (masked_softmax). Causal T_q > T_k, the other way to empty a row, is refused.
    q, k, v = qkv(2, 2, 6, 9, 4, dtype=torch.float64)
    mask = torch.rand(2, 1, 6, 9, generator=torch.Generator().manual_seed(5)) < 0.6
    mask[0, 0, 1] = False
    d_out = torch.randn(2, 2, 6, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    got = output_and_grads(lambda q, k, v: flash_out(q, k, v, mask, is_causal=True, tile_size=4), q, k, v, d_out)
    want = output_and_grads(lambda q, k, v: attention(q, k, v, mask, is_causal=True)[0], q, k, v, d_out)
    for a, b in zip(got, want):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b)
    assert torch.equal(got[0][0, :, 1], torch.zeros(2, 4, dtype=torch.float64))
    assert torch.equal(got[1][0, :, 1], torch.zeros(2, 4, dtype=torch.float64))  # dQ of the empty row
    small = [t[:1, :1].detach().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda q, k, v: flash_out(q, k, v, mask[:1], tile_size=4), small)


def test_bfloat16_is_computed_in_float32_blocks():
    q, k, v = qkv(1, 2, 40, 40, 16)
    out = flash_out(*(t.detach().bfloat16() for t in (q, k, v)), is_causal=True, tile_size=16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), sdpa(q, k, v, True).detach(), atol=2e-2, rtol=2e-2)


def test_no_grad_gives_the_same_output():
    q, k, v = qkv(1, 2, 19, 19, 8)
    with torch.no_grad():
        out = flash_out(q, k, v, is_causal=True, tile_size=4)
    assert not out.requires_grad
    torch.testing.assert_close(out, sdpa(q, k, v, True).detach(), **TOL)


def saved_bytes(fn, *inputs) -> int:
    """Bytes of the distinct storages the autograd graph keeps alive for backward (counted as they are saved)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def test_saved_for_backward_is_linear_in_T_where_eager_is_quadratic():
    B, H, d, f32 = 1, 2, 16, 4
    flash, eager = {}, {}
    for T in (256, 512, 1024):
        q, k, v = qkv(B, H, T, T, d)
        flash[T] = saved_bytes(lambda q, k, v: flash_out(q, k, v, is_causal=True), q, k, v)
        eager[T] = saved_bytes(lambda q, k, v: attention(q, k, v, is_causal=True)[0], q, k, v)
        # Q, K, V, O (B·H·T·d floats each) and L (B·H·T floats): nothing of size T².
        assert flash[T] == 4 * B * H * T * d * f32 + B * H * T * f32
        assert eager[T] >= B * H * T * T * f32  # at least the (T, T) weights of each head
    assert flash[512] == 2 * flash[256] and flash[1024] == 2 * flash[512]  # linear
    assert eager[1024] / eager[512] > 3.5 and eager[512] / eager[256] > 3.0  # quadratic dominates


def test_backward_saves_only_q_k_v_o_and_the_log_sum_exp():
    q, k, v = qkv(1, 2, 33, 33, 8)
    out = flash_out(q, k, v, tile_size=8)
    node = out.grad_fn
    while not isinstance(node, FlashAttentionFunction._backward_cls):  # past the reshape to the Function's node
        node = node.next_functions[0][0]
    shapes = [tuple(t.shape) for t in node.saved_tensors]
    # 4-D inputs are grouped as (B, n_kv_heads, group, T, d) before the Function: here 2 K/V heads, groups of 1.
    assert shapes == [(1, 2, 1, 33, 8)] * 4 + [(1, 2, 1, 33)]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda q, k, v: flash_attention(q, k, v, tile_size=0), ValueError, "tile_size=0 must be a positive integer"),
        (lambda q, k, v: flash_attention(q, k, v, tile_size=2.0), TypeError, r"tile_size must be an int; got 2\.0"),
        (lambda q, k, v: flash_attention(q.long(), k, v), TypeError, "q must be a floating point tensor"),
        (lambda q, k, v: flash_attention(q, k[..., :3], v), ValueError, "q and k must share head_dim"),
        (lambda q, k, v: flash_attention(q, k[:, :, :2], v[:, :, :2], is_causal=True), ValueError,
         "is_causal needs T_q <= T_k .* got T_q=5 > T_k=2"),
        (lambda q, k, v: flash_attention(q, k, v, is_causal=1), TypeError, "is_causal must be a bool; got 1"),
        (lambda q, k, v: flash_attention(q, k, v, True), TypeError,
         "mask must be a boolean torch.Tensor .True = may attend.; got bool"),  # is_causal is keyword-only now
        (lambda q, k, v: flash_attention(q, k, v, scale=-1.0), ValueError, r"scale=-1\.0 must be a finite number > 0"),
        (lambda q, k, v: flash_attention(q, k[:, :1].expand(1, 3, 5, 4), v[:, :1].expand(1, 3, 5, 4)), ValueError,
         "n_heads=2 must be a multiple of k's n_kv_heads=3"),
        (lambda q, k, v: flash_attention(q, k, v, mask=torch.ones(1, 1, 5, 5)), TypeError, "mask must be a boolean tensor"),
        (lambda q, k, v: flash_attention(q, k, v, mask=torch.ones(5, 5, dtype=torch.bool)), ValueError,
         r"mask of shape \(5, 5\) must have the scores' rank 4"),
    ],
)
def test_bad_inputs(call, error, match):
    q, k, v = (t.detach() for t in qkv(1, 2, 5, 5, 4))
    with pytest.raises(error, match=match):
        call(q, k, v)


def test_flash_is_the_registry_function_and_returns_no_weights():
    q, k, v = qkv(1, 2, 9, 9, 4)
    assert ATTENTION_FUNCTIONS["flash"] is flash_attention
    out, weights = ATTENTION_FUNCTIONS["flash"](q, k, v, None, is_causal=True, scale=None, dropout_p=0.0, score_mod=None)
    assert weights is None
    torch.testing.assert_close(out, sdpa(q, k, v, True), **TOL)


def test_refuses_a_score_mod_and_dropout_before_computing_anything():
    """Its backward pass differentiates plain scores and has no dropout: both are refused (ValueError, named)."""
    q, k, v = (t.detach() for t in qkv(1, 2, 5, 5, 4))
    calls = []

    def spy(score, b, h, q_idx, kv_idx):
        calls.append(score.shape)
        return score

    for mod in (spy, alibi(2), softcap(20.0)):
        with pytest.raises(ValueError, match=r"flash_attention cannot apply a score_mod .* use attn_fn='eager' or 'tiled'"):
            flash_attention(q, k, v, is_causal=True, score_mod=mod)
    assert calls == []  # refused before any score was computed
    for p in (0.1, 0.5):
        with pytest.raises(ValueError, match=rf"dropout_p={p} is not supported by flash_attention; use attn_fn='eager' or 'sdpa'"):
            flash_attention(q, k, v, dropout_p=p)
    with pytest.raises(ValueError, match=r"dropout_p=1\.0 must be in \[0, 1\)"):  # out of range: the shared check first
        flash_attention(q, k, v, dropout_p=1.0)
    torch.testing.assert_close(flash_out(q, k, v, dropout_p=0.0, score_mod=None), sdpa(q, k, v), **TOL)  # the defaults


def test_a_layer_with_flash_refuses_a_score_mod_and_trains_like_eager():
    """MultiHeadAttention(attn_fn="flash"): a score_mod is refused when the layer is built; otherwise its output
    and parameter gradients equal the eager layer's (float64)."""
    with pytest.raises(ValueError, match=r"score_mod needs attn_fn='eager' or 'tiled' \('flash' cannot modify scores\)"):
        MultiHeadAttention(16, 4, attn_fn="flash", score_mod=alibi(4))
    torch.manual_seed(0)
    layers = {fn: MultiHeadAttention(16, 4, 2, attn_fn=fn).double() for fn in ("eager", "flash")}
    layers["flash"].load_state_dict(layers["eager"].state_dict())
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    attention_mask = torch.ones(2, 11, dtype=torch.bool)
    attention_mask[1, :3] = False  # a left-padded row
    results = {}
    for fn, layer in layers.items():
        y = layer(x, attention_mask=attention_mask)
        y.square().sum().backward()
        results[fn] = (y, {name: p.grad for name, p in layer.named_parameters()})
    torch.testing.assert_close(results["flash"][0], results["eager"][0])
    for name, grad in results["eager"][1].items():
        torch.testing.assert_close(results["flash"][1][name], grad, msg=name)


def test_bench_flash_rows_and_table():
    from attnlib.bench.flash import flash_rows, format_flash

    rows = flash_rows([16, 32], methods=["flash", "naive"], n_heads=2, head_dim=8, tile_size=8, repeats=1, warmup=0,
                      device="cpu")
    assert [(r["method"], r["seq_len"]) for r in rows] == [(m, T) for T in (16, 32) for m in ("sdpa", "flash", "naive")]
    flash = {r["seq_len"]: r for r in rows if r["method"] == "flash"}
    assert flash[32]["saved_mib"] == 2 * flash[16]["saved_mib"]  # Q, K, V, O and L: linear in T
    assert all(r["max_abs_diff"] < 1e-5 and r["forward_backward_ms"] > 0 for r in rows)
    settings = dict(batch=1, n_heads=2, head_dim=8, causal=True, dtype="float32", tile_size=8, repeats=1, warmup=0)
    assert "saved / flash" in format_flash(rows, settings)
    with pytest.raises(ValueError, match="unknown method 'fast'"):
        flash_rows([16], methods=["fast"])
