"""Property-based checks of the library's promise, "the right answer or a clear error" (issue 26, part 2).

Hypothesis draws shapes, dtypes, masks, score modifications, caches and sampling settings for every
attention function, the multi-head layer, the decoder and the sampler, and checks the invariants:

* the output equals an independent float64 reference (written out below, never the library's own
  functions) within a dtype-based tolerance, zeros where a query may see no key, and no NaN; or the
  call raises the ``TypeError`` / ``ValueError`` its documentation names, with the argument in the message;
* bad arguments are refused before any kernel runs (no product, softmax or SDPA call is made);
* decoding with a cache, token by token or in chunks, gives the logits of one uncached pass;
* no input is mutated; sampled ids are always ones that may be sampled.

Every test is ``derandomize=True``: the same examples on every run (CI is reproducible).
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from attnlib.attention import ATTENTION_FUNCTIONS
from attnlib.attention.mods import alibi, softcap
from attnlib.attention.multi_head import MultiHeadAttention
from attnlib.generation import sample_next_token
from attnlib.models import Decoder, DecoderConfig

FUNCTIONS = sorted(ATTENTION_FUNCTIONS)
MODS = ("none", "alibi", "softcap", "inf_pattern")

#: Tolerances against the float64 reference, per input dtype: (absolute, relative to max |v|).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 1.5e-2, torch.bfloat16: 8e-2}

PROPERTY = functools.partial(settings, deadline=None, derandomize=True, database=None)  # the same examples on every machine


# --------------------------------------------------------------------------- the float64 reference


def reference_attention(q, k, v, mask=None, is_causal=False, scale=None, score_mod=None):
    """``softmax(q kᵀ · scale) v`` in float64, written out: grouped heads repeated, the causal mask built
    bottom-right by hand, a row that sees no key all zeros. Differentiable (the gradients' reference)."""
    q, k, v = q.double(), k.double(), v.double()
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    T_q, T_k = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("...qd,...kd->...qk", q, k) * scale
    allowed = torch.ones(scores.shape, dtype=torch.bool)
    if score_mod is not None:
        n = scores.dim()
        lead = [torch.arange(s).view(*([1] * i), s, *([1] * (n - 1 - i))) for i, s in enumerate(scores.shape[:-2])]
        b = lead[0] if n >= 3 else torch.tensor(0)
        h = lead[1] if n >= 4 else torch.tensor(0)
        q_idx = torch.arange(T_k - T_q, T_k).view(T_q, 1)  # a query's absolute position
        kv_idx = torch.arange(T_k).view(1, T_k)
        scores = score_mod(scores, b, h, q_idx, kv_idx)
        allowed &= scores != float("-inf")
    if mask is not None:
        allowed &= mask
    if is_causal:
        rows = torch.arange(T_q)[:, None] + (T_k - T_q)
        allowed &= torch.arange(T_k)[None, :] <= rows
    scores = scores.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(dim=-1, keepdim=True)
    top = scores.detach().amax(dim=-1, keepdim=True).masked_fill(empty, 0.0)
    e = torch.exp(scores - top)
    weights = e / e.sum(dim=-1, keepdim=True).masked_fill(empty, 1.0)
    return weights @ v, empty


def inf_pattern(pattern: torch.Tensor):
    """A score_mod that hides the keys where ``pattern`` (B, H, T_q, T_k) is False, by their indices."""

    def score_mod(score, b, h, q_idx, kv_idx):
        T_q, T_k = pattern.shape[-2:]
        seen = pattern[b, h, q_idx - (T_k - T_q), kv_idx]  # q_idx is absolute: the first query is T_k - T_q
        return score.masked_fill(~seen, float("-inf"))

    return score_mod


# --------------------------------------------------------------------------- 1. attention functions


@st.composite
def attention_case(draw, name: str, dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16)):
    rank = draw(st.sampled_from([4, 4, 4, 3]))
    B = draw(st.integers(1, 3))
    n_kv = draw(st.integers(1, 3)) if rank == 4 else 1
    H = n_kv * draw(st.integers(1, 3)) if rank == 4 else 1
    T_k = draw(st.integers(1, 9))
    T_q = draw(st.one_of(st.integers(1, T_k), st.integers(1, 9)))
    d = draw(st.integers(1, 12))
    d_v = draw(st.sampled_from([d, d, draw(st.integers(1, 6))]))
    dtype = draw(st.sampled_from(dtypes))
    scores_shape = (B, H, T_q, T_k) if rank == 4 else (B, T_q, T_k)
    mask = None
    if draw(st.booleans()):
        shape = [draw(st.sampled_from([1, s])) for s in scores_shape]
        density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        mask = torch.rand(shape, generator=g) < density
        if draw(st.booleans()):  # a row, or a whole query's rows, that sees nothing
            mask[..., draw(st.integers(0, shape[-2] - 1)), :] = False
    # sdpa and flash refuse every score_mod: draw one for them a quarter of the time, half the time for the others
    mod = draw(st.sampled_from(("none",) * 3 + MODS[1:] if name in ("eager", "tiled") else ("none",) * 9 + MODS[1:]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if mod == "alibi":
        score_mod = alibi(H)
    elif mod == "softcap":
        score_mod = softcap(draw(st.sampled_from([0.5, 2.0, 30.0])))
    elif mod == "inf_pattern":
        full = (B, H, T_q, T_k)
        score_mod = inf_pattern(torch.rand(full, generator=g) < draw(st.sampled_from([0.0, 0.5, 0.9])))
    else:
        score_mod = None
    magnitude = draw(st.sampled_from([0.1, 1.0, 3.0])) if dtype in (torch.float32, torch.float64) else 1.0
    q_shape = (B, H, T_q, d) if rank == 4 else (B, T_q, d)
    kv = (B, n_kv, T_k) if rank == 4 else (B, T_k)
    q = (torch.randn(q_shape, generator=g, dtype=torch.float64) * magnitude).to(dtype)
    k = (torch.randn(*kv, d, generator=g, dtype=torch.float64) * magnitude).to(dtype)
    v = torch.randn(*kv, d_v, generator=g, dtype=torch.float64).to(dtype)
    return dict(
        name=name, q=q, k=k, v=v, mask=mask, is_causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.sampled_from([0.05, 0.5, 1.0, 2.0]))),
        score_mod=score_mod, mod=mod, tile_size=draw(st.sampled_from([1, 2, 3, 128])),
    )


def function_of(case):
    fn = ATTENTION_FUNCTIONS[case["name"]]
    if case["name"] in ("tiled", "flash"):
        fn = functools.partial(fn, tile_size=case["tile_size"])
    return fn


def expected_error(case) -> tuple[type, str] | None:
    """The error the documentation promises for this case, or None (then the result must be right)."""
    T_q, T_k = case["q"].shape[-2], case["k"].shape[-2]
    if case["is_causal"] and T_q > T_k:
        return ValueError, "is_causal"
    if case["score_mod"] is not None and case["name"] in ("sdpa", "flash"):
        return ValueError, "score_mod"
    return None


def call(case, **changes):
    args = {**case, **changes}
    return function_of(case)(args["q"], args["k"], args["v"], args["mask"], is_causal=args["is_causal"],
                             scale=args["scale"], score_mod=args["score_mod"])


@pytest.mark.parametrize("name", FUNCTIONS)
@PROPERTY(max_examples=150)
@given(data=st.data())
def test_every_attention_function_equals_the_float64_reference_or_refuses(name, data):
    case = data.draw(attention_case(name))
    originals = {name: case[name].clone() for name in ("q", "k", "v") if case[name] is not None}
    mask_before = None if case["mask"] is None else case["mask"].clone()
    error = expected_error(case)
    event(f"{case['name']} {case['q'].dtype} mod={case['mod']} -> {'error' if error else 'result'}")
    if error is not None:
        with pytest.raises(error[0], match=error[1]):
            call(case)
    else:
        out, _ = call(case)
        ref, empty = reference_attention(case["q"], case["k"], case["v"], case["mask"], case["is_causal"],
                                         case["scale"], case["score_mod"])
        assert out.dtype == case["q"].dtype and out.shape == ref.shape
        assert not torch.isnan(out).any()
        assert torch.all(out.masked_select(empty) == 0), "a row that sees no key must give zeros"
        tol = TOLERANCE[case["q"].dtype]
        bound = tol * (1.0 + case["v"].double().abs().max().item())
        difference = (out.double() - ref).abs().max().item()
        assert difference <= bound, (case["name"], case["mod"], difference, bound)
    for name, before in originals.items():
        assert torch.equal(case[name], before), f"{name} was mutated"
    if mask_before is not None:
        assert torch.equal(case["mask"], mask_before), "mask was mutated"


@pytest.mark.parametrize("name", FUNCTIONS)
@PROPERTY(max_examples=25)
@given(data=st.data())
def test_gradients_are_finite_and_equal_the_references(name, data):
    case = data.draw(attention_case(name, dtypes=(torch.float64,)))
    assume(expected_error(case) is None)
    q, k, v = (case[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out, _ = call(case, q=q, k=k, v=v)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    rq, rk, rv = (case[n].clone().requires_grad_() for n in ("q", "k", "v"))
    ref, _ = reference_attention(rq, rk, rv, case["mask"], case["is_causal"], case["scale"], case["score_mod"])
    expected = torch.autograd.grad(ref, (rq, rk, rv), d_out)
    for name, got, want in zip("qkv", grads, expected):
        assert torch.isfinite(got).all(), f"d{name} is not finite"
        assert (got - want).abs().max().item() <= 1e-9, (case["name"], case["mod"], name)


# --------------------------------------------------------------------------- 2. bad arguments, refused first

#: What a kernel computes with: none of these may run before a bad argument is refused.
KERNELS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.einsum, torch.softmax,
           torch.Tensor.softmax, F.softmax, torch.exp, torch.Tensor.exp, F.scaled_dot_product_attention, F.linear}


class KernelSpy(TorchFunctionMode):
    """Records every kernel of :data:`KERNELS` called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in KERNELS:
            self.calls.append(getattr(func, "__name__", func))
        return func(*args, **(kwargs or {}))


#: kind -> (error, the words the message must contain: the argument's name)
BAD_ARGUMENTS = {
    "q_integer": (TypeError, "q must be a floating point"),
    "k_bool": (TypeError, "k must be a floating point"),
    "v_not_a_tensor": (TypeError, "v must be a torch.Tensor"),
    "mixed_dtypes": (TypeError, "q, k, v must share a dtype"),
    "mixed_ranks": (ValueError, "q, k, v must have the same rank"),
    "head_dim_mismatch": (ValueError, "q and k must share head_dim"),
    "v_length_mismatch": (ValueError, "k and v must agree"),
    "heads_not_a_multiple": (ValueError, "n_kv_heads"),
    "batch_mismatch": (ValueError, "batch size"),
    "no_keys": (ValueError, "T_k=0"),
    "mask_rank": (ValueError, "mask of shape"),
    "mask_dtype": (TypeError, "mask must be a boolean"),
    "mask_size": (ValueError, "mask of shape"),
    "mask_not_a_tensor": (TypeError, "mask must be a boolean torch.Tensor"),
    "is_causal_type": (TypeError, "is_causal must be a bool"),
    "scale_value": (ValueError, "scale="),
    "scale_type": (TypeError, "scale must be a float"),
    "dropout_value": (ValueError, "dropout_p="),
    "dropout_type": (TypeError, "dropout_p must be a float"),
    "score_mod_type": (TypeError, "score_mod must be callable"),
    "tile_size": ((TypeError, ValueError), "tile_size"),  # tiled and flash only
    "dropout_unsupported": (ValueError, "dropout_p=0.5 is not supported"),  # tiled and flash only
}


@st.composite
def bad_call(draw, kind: str):
    B, n_kv, group, T_q, T_k, d = (draw(st.integers(1, 3)) for _ in range(6))
    H = n_kv * group
    q, k, v = torch.randn(B, H, T_q, d), torch.randn(B, n_kv, T_k, d), torch.randn(B, n_kv, T_k, d)
    args = dict(q=q, k=k, v=v, mask=None, is_causal=False, scale=None, dropout_p=0.0, score_mod=None)
    extra = {}
    if kind == "q_integer":
        args["q"] = q.to(draw(st.sampled_from([torch.int64, torch.int32, torch.uint8])))
    elif kind == "k_bool":
        args["k"] = k > 0
    elif kind == "v_not_a_tensor":
        args["v"] = draw(st.sampled_from([v.tolist(), v.numpy(), None]))
    elif kind == "mixed_dtypes":
        args[draw(st.sampled_from("kv"))] = draw(st.sampled_from([k.double(), k.half(), k.bfloat16()]))
    elif kind == "mixed_ranks":
        args["k"], args["v"] = k[0], v[0]
    elif kind == "head_dim_mismatch":
        args["k"] = torch.randn(B, n_kv, T_k, d + draw(st.integers(1, 3)))
    elif kind == "v_length_mismatch":
        args["v"] = torch.randn(B, n_kv, T_k + draw(st.integers(1, 3)), d)
    elif kind == "heads_not_a_multiple":
        n_kv = H + draw(st.integers(1, 2))  # more key/value heads than query heads
        args["k"], args["v"] = torch.randn(B, n_kv, T_k, d), torch.randn(B, n_kv, T_k, d)
    elif kind == "batch_mismatch":
        args["q"] = torch.randn(B + draw(st.integers(1, 2)), H, T_q, d)
    elif kind == "no_keys":
        args["k"], args["v"] = torch.randn(B, n_kv, 0, d), torch.randn(B, n_kv, 0, d)
    elif kind == "mask_rank":
        args["mask"] = draw(st.sampled_from([torch.ones(B, T_k, dtype=torch.bool),
                                             torch.ones(T_q, T_k, dtype=torch.bool),
                                             torch.ones(1, B, H, T_q, T_k, dtype=torch.bool)]))
    elif kind == "mask_dtype":
        args["mask"] = torch.ones(B, H, T_q, T_k, dtype=draw(st.sampled_from([torch.float32, torch.int64, torch.uint8])))
    elif kind == "mask_size":
        shape = [B, H, T_q, T_k]
        shape[draw(st.integers(0, 3))] += draw(st.integers(1, 2))
        if shape[0] == 1 or shape[1] == 1 or shape[2] == 1:
            shape[3] = T_k + 1  # a dim that became 1 would broadcast: grow the keys' instead
        args["mask"] = torch.ones(shape, dtype=torch.bool)
    elif kind == "mask_not_a_tensor":
        args["mask"] = draw(st.sampled_from([[[True]], 1, True]))
    elif kind == "is_causal_type":
        args["is_causal"] = draw(st.sampled_from([1, 0, "yes", 1.0, torch.tensor(True)]))
    elif kind == "scale_value":
        args["scale"] = draw(st.sampled_from([0, 0.0, -1.0, -1e-9, math.nan, math.inf, -math.inf]))
    elif kind == "scale_type":
        args["scale"] = draw(st.sampled_from([True, "0.5", torch.tensor(0.5), [0.5]]))
    elif kind == "dropout_value":
        args["dropout_p"] = draw(st.sampled_from([-0.1, 1.0, 1.5, math.nan, math.inf]))
    elif kind == "dropout_type":
        args["dropout_p"] = draw(st.sampled_from([True, "0.1", None, torch.tensor(0.1)]))
    elif kind == "score_mod_type":
        args["score_mod"] = draw(st.sampled_from([3, "alibi", torch.zeros(1)]))
    elif kind == "tile_size":
        extra["tile_size"] = draw(st.sampled_from([0, -1, 1.5, True, "64", None]))
    elif kind == "dropout_unsupported":
        args["dropout_p"] = 0.5
    return args, extra


@pytest.mark.parametrize("name, kind", [(name, kind) for name in FUNCTIONS for kind in BAD_ARGUMENTS
                                        if name in ("tiled", "flash") or kind not in ("tile_size", "dropout_unsupported")])
@PROPERTY(max_examples=10)
@given(data=st.data())
def test_bad_arguments_are_refused_before_any_kernel_with_the_argument_named(name, kind, data):
    args, extra = data.draw(bad_call(kind))
    error, words = BAD_ARGUMENTS[kind]
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    spy = KernelSpy()
    with spy, pytest.raises(error) as raised:
        ATTENTION_FUNCTIONS[name](q, k, v, args.pop("mask"), **args, **extra)
    assert words in str(raised.value), (kind, str(raised.value))
    assert not spy.calls, f"{kind}: {spy.calls} ran before the error"


@functools.lru_cache(maxsize=2)
def tiny_decoder(block_size: int = 8) -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=11, block_size=block_size, n_layers=1, n_heads=2, d_model=8)).eval()


# --------------------------------------------------------------------------- 3. the layer and the decoder

LAYER_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def left_padding_mask(draw, B: int, T: int) -> torch.Tensor:
    """``(B, T)`` bool, each row ``n_pad`` False then True, at least one real token per row."""
    pads = [draw(st.integers(0, T - 1)) for _ in range(B)]
    return torch.arange(T)[None, :] >= torch.tensor(pads)[:, None]


def reference_layer(layer, x, attention_mask=None):
    """What ``MultiHeadAttention`` (no RoPE, default positions) computes, in float64 from its weights."""
    x = x.double()
    B, T, _ = x.shape
    H, n_kv, hd = layer.n_heads, layer.n_kv_heads, layer.head_dim
    w = layer.qkv.weight.double()
    b = None if layer.qkv.bias is None else layer.qkv.bias.double()
    qkv = x @ w.T + (0 if b is None else b)
    q, k, v = qkv.split([H * hd, n_kv * hd, n_kv * hd], dim=-1)
    q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
    if layer.q_norm is not None:  # RMSNorm over head_dim
        def rms(t, norm):
            return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
        q, k = rms(q, layer.q_norm), rms(k, layer.k_norm)
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool)
    positions = torch.arange(T).expand(B, T)
    if attention_mask is not None:
        allowed &= attention_mask[:, None, None, :]
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # each row counts its real tokens
    qp, kp = positions[:, None, :, None], positions[:, None, None, :]
    if layer.sliding_window is not None:
        allowed &= (qp - kp < layer.sliding_window) & (kp <= qp)
    if layer.chunk_size is not None:
        allowed &= (qp // layer.chunk_size == kp // layer.chunk_size) & (kp <= qp)
    y, _ = reference_attention(q, k, v, allowed, layer.causal, layer.scale, layer.score_mod)
    y = y.transpose(1, 2).reshape(B, T, H * hd)
    return y @ layer.out_proj.weight.double().T + (0 if layer.out_proj.bias is None else layer.out_proj.bias.double())


@pytest.mark.parametrize("attn_fn", FUNCTIONS)
@PROPERTY(max_examples=100)
@given(data=st.data())
def test_multi_head_attention_equals_the_reference_and_its_cache_changes_nothing(attn_fn, data):
    draw = data.draw
    n_kv = draw(st.integers(1, 3))
    H = n_kv * draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 6))
    d_model = draw(st.sampled_from([H * head_dim, 8]))
    causal = draw(st.sampled_from([True, True, False]))
    rule = draw(st.sampled_from(["none", "window", "chunk"])) if causal else "none"
    size = draw(st.integers(1, 5))
    mod = draw(st.sampled_from(["none", "none", "alibi", "softcap"]))
    score_mod = {"none": None, "alibi": alibi(H), "softcap": softcap(draw(st.sampled_from([0.5, 5.0])))}[mod]
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    options = dict(block_size=16, causal=causal, attn_fn=attn_fn, head_dim=head_dim, bias=draw(st.booleans()),
                   kv_sharing=draw(st.sampled_from(["fold", "repeat_interleave"])), qk_norm=draw(st.booleans()),
                   sliding_window=size if rule == "window" else None, chunk_size=size if rule == "chunk" else None,
                   score_mod=score_mod)
    if score_mod is not None and attn_fn in ("sdpa", "flash"):
        with pytest.raises(ValueError, match="score_mod needs attn_fn='eager' or 'tiled'"):
            MultiHeadAttention(d_model, H, n_kv, **options)
        return
    torch.manual_seed(draw(st.integers(0, 2**16)))
    layer = MultiHeadAttention(d_model, H, n_kv, **options).to(dtype).eval()
    B, T = draw(st.integers(1, 3)), draw(st.integers(1, 10))
    x = torch.randn(B, T, d_model, dtype=dtype)
    attention_mask = left_padding_mask(draw, B, T) if draw(st.sampled_from([True, True, False])) else None
    before = (x.clone(), None if attention_mask is None else attention_mask.clone())
    with torch.no_grad():
        y = layer(x, attention_mask=attention_mask)
        ref = reference_layer(layer, x, attention_mask)
    assert not torch.isnan(y).any()
    tol = LAYER_TOLERANCE[dtype] * 10 * (1.0 + ref.abs().max().item())
    assert (y.double() - ref).abs().max().item() <= tol, (attn_fn, rule, mod)
    if causal:  # the same positions through a cache, in chunks
        windows = draw(st.booleans())
        cache = layer.new_cache(16, windows=windows)
        chunks, start, outs = [], 0, []
        while start < T:
            chunks.append(draw(st.integers(1, T - start)))
            start += chunks[-1]
        refuses = windows and rule == "chunk" and attention_mask is not None
        start = 0
        with torch.no_grad():
            for n in chunks:
                am = None if attention_mask is None else attention_mask[:, :start + n]
                if refuses:
                    with pytest.raises(ValueError, match="masks are not supported with a chunked cache"):
                        layer(x[:, start:start + n], attention_mask=am, cache=cache)
                    break
                outs.append(layer(x[:, start:start + n], attention_mask=am, cache=cache))
                start += n
        if not refuses:
            cached = torch.cat(outs, dim=1)
            assert (cached - y).abs().max().item() <= LAYER_TOLERANCE[dtype] * (1.0 + y.abs().max().item()), chunks
    assert torch.equal(x, before[0]) and (attention_mask is None or torch.equal(attention_mask, before[1]))


#: kind -> (error, words of the message); each a bad argument of MultiHeadAttention.forward or Decoder.forward
BAD_MODULE_INPUTS = {
    "x_integer": (TypeError, "x must be a floating point tensor"),
    "x_width": (ValueError, "x must have shape (B, T, d_model=8)"),
    "x_dtype": (TypeError, "x is torch.float64 but the module's weights are torch.float32"),
    "mask_dtype": (TypeError, "mask must be a boolean tensor"),
    "mask_rank": (ValueError, "must be 4-D and broadcast to (B, n_heads, T_q, T_k)"),
    "attention_mask_integer": (TypeError, "attention_mask must be a boolean tensor"),
    "attention_mask_shape": (ValueError, "attention_mask must have shape (B, T_k)"),
    "positions_float": (TypeError, "positions must be an integer tensor"),
    "positions_negative": (ValueError, "positions must be >= 0"),
    "cache_type": (TypeError, "cache must be a layer cache"),
    "too_long": (ValueError, "exceeds block_size=6"),
    "idx_float": (TypeError, "idx must hold integer token ids"),
    "idx_outside_vocabulary": (ValueError, "idx holds token id"),
    "idx_too_long": (ValueError, "exceeds block_size=6"),
    "model_attention_mask_padding_only": (ValueError, "is all padding"),
    "model_cache_type": (TypeError, "cache must be an attnlib.cache.KVCache"),
}


@functools.lru_cache(maxsize=1)
def tiny_layer() -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(8, 2, block_size=6, attn_fn="eager").eval()


@pytest.mark.parametrize("kind", sorted(BAD_MODULE_INPUTS))
@PROPERTY(max_examples=5)
@given(B=st.integers(1, 3), T=st.integers(1, 6))
def test_bad_module_inputs_are_refused_before_any_kernel_naming_the_argument(kind, B, T):
    error, words = BAD_MODULE_INPUTS[kind]
    x, idx = torch.randn(B, T, 8), torch.randint(0, 11, (B, T))
    layer_args, model_args = {}, {}
    if kind == "x_integer":
        x = x.long()
    elif kind == "x_width":
        x = torch.randn(B, T, 9)
    elif kind == "x_dtype":
        x = x.double()
    elif kind == "mask_dtype":
        layer_args["mask"] = torch.ones(B, 1, T, T)
    elif kind == "mask_rank":
        layer_args["mask"] = torch.ones(B, T, dtype=torch.bool)
    elif kind == "attention_mask_integer":
        layer_args["attention_mask"] = torch.ones(B, T, dtype=torch.long)
    elif kind == "attention_mask_shape":
        layer_args["attention_mask"] = torch.ones(B, T + 1, dtype=torch.bool)
    elif kind == "positions_float":
        layer_args["positions"] = torch.zeros(B, T)
    elif kind == "positions_negative":
        layer_args["positions"] = torch.arange(T).expand(B, T) - 1
    elif kind == "cache_type":
        layer_args["cache"] = [torch.zeros(1)]
    elif kind == "too_long":
        x = torch.randn(B, 7, 8)
    elif kind == "idx_float":
        idx = idx.float()
    elif kind == "idx_outside_vocabulary":
        idx[-1, -1] = 11
    elif kind == "idx_too_long":
        idx = torch.randint(0, 11, (B, 7))
    elif kind == "model_attention_mask_padding_only":
        model_args["attention_mask"] = torch.ones(B, T, dtype=torch.bool)
        model_args["attention_mask"][-1] = False
    elif kind == "model_cache_type":
        model_args["cache"] = tiny_layer().new_cache(6)
    spy = KernelSpy()
    with spy, pytest.raises(error) as raised:
        if kind.startswith(("idx", "model")):
            tiny_decoder(block_size=6)(idx, **model_args)
        else:
            tiny_layer()(x, **layer_args)
    assert words in str(raised.value), (kind, str(raised.value))
    assert not spy.calls, f"{kind}: {spy.calls} ran before the error"


DECODERS = ("gpt2", "llama", "qwen3", "mistral", "sliding+full", "chunked+full", "alibi", "softcap")


def decoder_config(kind: str, attn_fn: str, window: int) -> DecoderConfig:
    small = dict(vocab_size=29, block_size=12, n_layers=2, n_heads=4, d_model=16, attn_fn=attn_fn)
    if kind == "gpt2":
        return DecoderConfig(**small)
    if kind == "llama":
        return DecoderConfig.llama(n_kv_heads=2, **small)
    if kind == "qwen3":
        return DecoderConfig.qwen3(n_kv_heads=1, head_dim=6, **small)
    if kind == "mistral":
        return DecoderConfig.mistral(sliding_window=window, n_kv_heads=2, **small)
    if kind == "sliding+full":
        return DecoderConfig.llama(layer_types=("sliding_attention", "full_attention"), sliding_window=window, **small)
    if kind == "chunked+full":
        return DecoderConfig.llama(layer_types=("chunked_attention", "full_attention"), attention_chunk_size=window,
                                   **small)
    if kind == "alibi":
        return DecoderConfig(position="alibi", **small)
    return DecoderConfig.llama(attn_softcap=2.0, **small)  # softcap


@pytest.mark.parametrize("kind", DECODERS)
@PROPERTY(max_examples=25)
@given(data=st.data())
def test_decoder_cached_decoding_equals_one_uncached_pass_and_padding_changes_nothing(kind, data):
    draw = data.draw
    attn_fn = draw(st.sampled_from(["eager", "sdpa", "tiled"]))
    window = draw(st.integers(1, 5))
    if kind in ("alibi", "softcap") and attn_fn == "sdpa":
        with pytest.raises(ValueError, match="cannot modify scores"):
            decoder_config(kind, attn_fn, window)
        return
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = Decoder(decoder_config(kind, attn_fn, window)).to(dtype).eval()
    B, T = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    idx = torch.randint(0, 29, (B, T), generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
    attention_mask = left_padding_mask(draw, B, T)
    before = (idx.clone(), attention_mask.clone())
    tol = LAYER_TOLERANCE[dtype]
    with torch.no_grad():
        full = model(idx)[0]
        assert not torch.isnan(full).any()
        # token by token, or in chunks, through the cache (windowed caches or full ones)
        windows = draw(st.booleans())
        chunks, start = [], 0
        while start < T:
            chunks.append(draw(st.sampled_from([1, draw(st.integers(1, T - start))])) if start < T else 0)
            chunks[-1] = min(chunks[-1], T - start)
            start += chunks[-1]
        cache, outs, start = model.new_cache(windows), [], 0
        for n in chunks:
            outs.append(model(idx[:, start:start + n], cache=cache)[0])
            start += n
        difference = (torch.cat(outs, dim=1) - full).abs().max().item()
        assert difference <= tol * (1 + full.abs().max().item()), (chunks, windows, difference)
        # left padding: finite everywhere, and each row's real tokens get the logits the row gets alone
        padded = model(idx, attention_mask=attention_mask)[0]
        assert not torch.isnan(padded).any()
        for b in range(B):
            first = int((~attention_mask[b]).sum())
            alone = model(idx[b:b + 1, first:])[0]
            difference = (padded[b:b + 1, first:] - alone).abs().max().item()
            assert difference <= tol * (1 + alone.abs().max().item()), (b, first, difference)
        # and through a cache (the first chunk holding a real token of every row, as a prompt must; a
        # chunked layer's own cache refuses padding, naming why)
        n_pad = int((~attention_mask).sum(-1).max())
        first = sum(chunks[:1 + next(i for i in range(len(chunks)) if sum(chunks[:i + 1]) > n_pad)])
        padded_chunks = [first] + chunks[next(i for i in range(len(chunks)) if sum(chunks[:i + 1]) == first) + 1:]
        cache, start = model.new_cache(windows), 0
        for n in padded_chunks:
            am = attention_mask[:, :start + n]
            if windows and kind == "chunked+full":
                with pytest.raises(ValueError, match="masks are not supported with a chunked cache"):
                    model(idx[:, start:start + n], cache=cache, attention_mask=am)
                break
            out = model(idx[:, start:start + n], cache=cache, attention_mask=am)[0]
            real = attention_mask[:, start:start + n]
            difference = (out - padded[:, start:start + n]).abs().amax(-1).masked_select(real)
            assert difference.numel() == 0 or difference.max().item() <= tol * (1 + padded.abs().max().item())
            start += n
        # greedy decoding: the same tokens with and without the cache
        n_new = draw(st.integers(1, 4))
        greedy = model.generate(idx, n_new, temperature=0, attention_mask=attention_mask)
        assert torch.equal(greedy, model.generate(idx, n_new, temperature=0, attention_mask=attention_mask,
                                                  use_cache=False))
    assert torch.equal(idx, before[0]) and torch.equal(attention_mask, before[1])


# --------------------------------------------------------------------------- 4. sampling

TEMPERATURES = [0.0, 0, 1e-300, 1e-45, 1e-30, 1e-8, 0.1, 0.7, 1, 1.0, 2.0, 100.0]


@st.composite
def logits_rows(draw):
    B, V = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    finite = st.floats(-60, 60, allow_nan=False, allow_infinity=False, width=16 if dtype == torch.float16 else 32)
    values = draw(st.lists(st.one_of(finite, finite, st.just(-math.inf)), min_size=B * V, max_size=B * V))
    logits = torch.tensor(values, dtype=torch.float64).view(B, V).to(dtype)
    for b in range(B):
        if not torch.isfinite(logits[b]).any():  # every row keeps at least one finite logit
            logits[b, draw(st.integers(0, V - 1))] = draw(finite)
    return logits


def reference_distribution(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """Each row's probabilities at ``temperature`` after the top-k filter, in float64."""
    scores = logits.double()
    top = scores.amax(-1, keepdim=True)
    if top_k is not None:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    return torch.softmax((scores - top) / temperature, dim=-1)


@PROPERTY(max_examples=400)
@given(logits=logits_rows(), temperature=st.sampled_from(TEMPERATURES),
       top_k=st.one_of(st.none(), st.integers(1, 14)), top_p=st.one_of(st.none(), st.floats(1e-6, 1.0), st.just(1.0)),
       seed=st.integers(0, 2**16))
def test_sampled_ids_are_always_ones_that_may_be_sampled(logits, temperature, top_k, top_p, seed):
    before = logits.clone()
    ids = sample_next_token(logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed))
    assert ids.shape == (logits.shape[0], 1) and ids.dtype == torch.long
    assert torch.equal(logits, before), "logits were mutated"
    rows = logits.double()
    for b, i in enumerate(ids[:, 0].tolist()):
        row = rows[b]
        assert 0 <= i < row.numel() and math.isfinite(row[i].item()), (b, i, row.tolist())
        if temperature == 0:
            assert row[i] == row.max(), "temperature 0 must give the argmax"
            continue
        if top_k is not None:
            kth = row.topk(min(top_k, row.numel())).values[-1]
            assert row[i] >= kth, f"id {i} is not among the top {top_k}"
        probs = reference_distribution(row, temperature, top_k)
        assert probs[i] > 1e-20, f"id {i} has probability {probs[i].item()}"
        if top_p is not None:  # the tokens more likely than it do not already make up top_p
            more = probs[probs > probs[i]].sum().item()
            assert more < top_p + 1e-5, (i, more, top_p)


#: setting -> bad values and the error each gives
BAD_SETTINGS = {
    "temperature": [(-1.0, ValueError), (-1e-30, ValueError), (math.nan, ValueError), (math.inf, ValueError),
                    (True, TypeError), ("1", TypeError), (None, TypeError), (torch.tensor(1.0), TypeError)],
    "top_k": [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError), ("5", TypeError)],
    "top_p": [(0.0, ValueError), (-0.5, ValueError), (1.5, ValueError), (math.nan, ValueError), (math.inf, ValueError),
              (True, TypeError), ("0.9", TypeError)],
}




@PROPERTY(max_examples=120)
@given(setting=st.sampled_from(sorted(BAD_SETTINGS)), data=st.data(), where=st.sampled_from(["sample", "generate"]))
def test_bad_sampling_settings_are_refused_naming_the_setting(setting, data, where):
    value, error = data.draw(st.sampled_from(BAD_SETTINGS[setting]))
    others = {"temperature": data.draw(st.sampled_from([0.0, 1.0])), "top_k": None, "top_p": None}
    settings_ = {**others, setting: value}
    with pytest.raises(error, match=setting):
        if where == "sample":
            sample_next_token(torch.randn(2, 11), **settings_)
        else:
            tiny_decoder().generate(torch.zeros(1, 3, dtype=torch.long), 2, **settings_)


@PROPERTY(max_examples=60)
@given(logits=logits_rows(), bad=st.sampled_from([math.nan, math.inf, "empty"]), data=st.data())
def test_logits_no_token_can_come_from_are_refused(logits, bad, data):
    row = data.draw(st.integers(0, logits.shape[0] - 1))
    if bad == "empty":
        logits[row] = -math.inf
    else:
        logits[row, data.draw(st.integers(0, logits.shape[1] - 1))] = bad
    with pytest.raises(ValueError, match=f"logits row {row} holds NaN or \\+inf, or no finite value"):
        sample_next_token(logits, data.draw(st.sampled_from(TEMPERATURES)))
