"""Exercise checks for chapter 14 (exercises 3.1–3.3 of *LLMs from Scratch*, and GPT-2).

* 14.1 ``check_copy_head``: ``copy_head(src, dst)`` copies one attention head into another,
  between :class:`attnlib.SelfAttentionV1` (``nn.Parameter``) and :class:`attnlib.SelfAttentionV2`
  (``nn.Linear``) in either direction, so that ``dst(x) == src(x)`` and ``dst`` owns its weights.
* 14.2 ``check_wrapper_with_width``: ``wrapper_with_width(d_model, block_size, n_heads, d_out)``
  returns an unchanged :class:`attnlib.MultiHeadAttentionWrapper` whose output is ``d_out`` wide.
* 14.3 ``check_gpt2_attention``: ``gpt2_attention(qkv_bias)`` returns a GPT-2-sized
  :class:`attnlib.MultiHeadAttention` with 2,362,368 (``qkv_bias=True``) or 2,360,064 parameters.
* 14.4 ``check_hf_key``: ``hf_key(name, tensor)`` maps one entry of a Hugging Face GPT-2
  state dict to attnlib's name and layout (``None`` for what is not a weight).
* 14.5 ``check_gpt2_init``: ``gpt2_init_(model)`` initialises an :class:`attnlib.GPT` in place as
  GPT-2 does (Radford et al. 2019, §2.3; ``transformers``' ``GPT2PreTrainedModel._init_weights``):
  N(0, 0.02) weights, the residual projections N(0, 0.02 / sqrt(2 n_layers)), zero biases,
  LayerNorms the identity; checked by the statistics of every tensor on two depths.

Every grader draws its test weights from a local ``torch.Generator``; ``grade`` runs it
inside ``torch.random.fork_rng``, so checking an answer never moves the notebook's global
random state.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlib.attention import MultiHeadAttention, MultiHeadAttentionWrapper, SelfAttentionV1, SelfAttentionV2
from attnlib.book.exercises._core import NotSolved, Wrong, exercise, expect, expect_close
from attnlib.models import GPT, GPTConfig
from attnlib.models.hf_gpt2 import hf_gpt2_key_map

__all__ = [
    "check_copy_head",
    "check_wrapper_with_width",
    "check_gpt2_attention",
    "check_hf_key",
    "check_gpt2_init",
]

_PROJECTIONS = ("W_query", "W_key", "W_value")


# ---------------------------------------------------------------- 14.1


def _matrix(head: nn.Module, name: str) -> torch.Tensor:
    """The projection ``name`` of ``head`` as the ``(d_model, head_dim)`` matrix it multiplies from the right."""
    p = getattr(head, name)
    return p.weight.detach().t() if isinstance(p, nn.Linear) else p.detach()


def _stored(head: nn.Module, name: str) -> torch.Tensor:
    """The projection ``name`` of ``head`` as stored: V1's ``(d_model, head_dim)``, nn.Linear's ``(head_dim, d_model)``."""
    p = getattr(head, name)
    return (p.weight if isinstance(p, nn.Linear) else p).detach()


def _random_head(kind: type, d_model: int, head_dim: int, g: torch.Generator) -> nn.Module:
    """A V1 or V2 head (no bias) with weights drawn from ``g``."""
    head = kind(d_model, head_dim)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(d_model))
    return head


_COPY_CASES = [  # (source class, destination class, d_model, head_dim): the exercise's direction first
    (SelfAttentionV2, SelfAttentionV1, 5, 3),
    (SelfAttentionV2, SelfAttentionV1, 4, 4),
    (SelfAttentionV1, SelfAttentionV2, 6, 2),
    (SelfAttentionV1, SelfAttentionV2, 3, 3),
]


def _check_layout(dst: nn.Module, d_model: int, head_dim: int, case: str) -> None:
    """``dst`` still has its class's parameters, registered, with their shapes."""
    registered = {id(p) for p in dst.parameters()}
    for name in _PROJECTIONS:
        p = getattr(dst, name)
        if isinstance(dst, SelfAttentionV1):
            expect(isinstance(p, nn.Parameter) and id(p) in registered,
                   f"{case}: dst.{name} must stay a registered nn.Parameter (got {type(p).__name__})")
            expect(tuple(p.shape) == (d_model, head_dim),
                   f"{case}: dst.{name} has shape {tuple(p.shape)}; a SelfAttentionV1 keeps (d_model, head_dim) = "
                   f"{(d_model, head_dim)}")
            expect(p.requires_grad, f"{case}: dst.{name} no longer requires grad, so dst could not be trained")
        else:
            expect(isinstance(p, nn.Linear), f"{case}: dst.{name} must stay an nn.Linear (got {type(p).__name__})")
            expect(tuple(p.weight.shape) == (head_dim, d_model),
                   f"{case}: dst.{name}.weight has shape {tuple(p.weight.shape)}; nn.Linear keeps "
                   f"(out_features, in_features) = {(head_dim, d_model)}")
            expect(p.weight.requires_grad, f"{case}: dst.{name}.weight no longer requires grad")


def _name_the_mistake(src: nn.Module, dst: nn.Module, case: str) -> None:
    """Raise :class:`Wrong` naming a recognised wrong copy of a projection, if any."""
    for name in _PROJECTIONS:
        want, got = _matrix(src, name), _matrix(dst, name)
        if torch.equal(got, want):
            continue
        if torch.equal(got, want.t()):
            raise Wrong(f"{case}: {name} was copied without a transpose (the head is square, so the shapes fit "
                        "anyway). A SelfAttentionV1 computes x @ W, nn.Linear computes x @ weight.T: "
                        "W = weight.T")
        stored_src, stored_dst = _stored(src, name), _stored(dst, name)
        if stored_src.shape != stored_dst.shape and torch.equal(stored_dst, stored_src.reshape(stored_dst.shape)):
            raise Wrong(f"{case}: {name} was reshaped instead of transposed. reshape/view keep the order of the "
                        "numbers and only change the shape; the transpose reorders them: use .T")
        raise Wrong(f"{case}: dst's {name} is not src's matrix (compare x @ W with nn.Linear's x @ weight.T)")


@exercise("14.1")
def check_copy_head(copy_head) -> None:
    """Check ``copy_head(src, dst)`` between SelfAttentionV1 and SelfAttentionV2, both ways, on square and non-square heads."""
    g = torch.Generator().manual_seed(1401)
    for src_kind, dst_kind, d_model, head_dim in _COPY_CASES:
        src = _random_head(src_kind, d_model, head_dim, g)
        dst = _random_head(dst_kind, d_model, head_dim, g)
        case = f"{src_kind.__name__} -> {dst_kind.__name__} (d_model={d_model}, head_dim={head_dim})"
        src_before = {k: v.clone() for k, v in src.state_dict().items()}
        dst_before = {k: v.clone() for k, v in dst.state_dict().items()}

        copy_head(src, dst)

        expect(all(torch.equal(v, src_before[k]) for k, v in src.state_dict().items()),
               f"{case}: your function changed src; copy from it, leave it as it was")
        if all(k in dst_before and torch.equal(v, dst_before[k]) for k, v in dst.state_dict().items()):
            raise NotSolved("dst still has its own weights: copy src's weights into dst")
        _check_layout(dst, d_model, head_dim, case)
        _name_the_mistake(src, dst, case)

        x = torch.randn(2, 6, d_model, generator=g)
        with torch.no_grad():
            expect_close(dst(x), src(x), f"{case}: dst(x) (compared with src(x))")

        # dst must own its weights: a training step on src (an in-place update) must not move dst.
        copied = {name: _matrix(dst, name).clone() for name in _PROJECTIONS}
        with torch.no_grad():
            for p in src.parameters():
                p.add_(1.0)
        for name in _PROJECTIONS:
            expect(torch.equal(_matrix(dst, name), copied[name]),
                   f"{case}: dst.{name} shares memory with src (changing src changed dst). nn.Parameter(t) "
                   "wraps t without copying it, and .T is a view: copy the numbers (.clone(), or copy_ under "
                   "torch.no_grad())")


# ---------------------------------------------------------------- 14.2

_WIDTH_CASES = [  # (d_model, block_size, n_heads, d_out): exercise 3.2 first
    (3, 6, 2, 2),
    (8, 5, 4, 4),
    (6, 7, 3, 6),
    (5, 4, 2, 6),
]


@exercise("14.2")
def check_wrapper_with_width(wrapper_with_width) -> None:
    """Check ``wrapper_with_width(d_model, block_size, n_heads, d_out)``: a plain wrapper whose output is ``d_out`` wide."""
    g = torch.Generator().manual_seed(1402)
    for d_model, block_size, n_heads, d_out in _WIDTH_CASES:
        case = f"wrapper_with_width(d_model={d_model}, block_size={block_size}, n_heads={n_heads}, d_out={d_out})"
        wrapper = wrapper_with_width(d_model, block_size, n_heads, d_out)
        if wrapper is None:
            raise NotSolved("return an attnlib.MultiHeadAttentionWrapper, not None")
        expect(type(wrapper) is MultiHeadAttentionWrapper,
               f"{case}: return an attnlib.MultiHeadAttentionWrapper itself (the exercise keeps the class as it "
               f"is); got {type(wrapper).__name__}")
        expect(len(wrapper.heads) == n_heads, f"{case}: the wrapper has {len(wrapper.heads)} head(s), not {n_heads}")
        widths = [head.head_dim for head in wrapper.heads]
        expect(sum(widths) == d_out,
               f"{case}: the heads are {widths} wide, so the output has {sum(widths)} features, not {d_out}. The "
               "wrapper concatenates n_heads outputs of head_dim features each: choose head_dim = d_out // n_heads")
        expect(all(head.d_model == d_model for head in wrapper.heads),
               f"{case}: every head must read d_model={d_model} features")
        expect(all(head.block_size == block_size for head in wrapper.heads),
               f"{case}: build the heads with block_size={block_size}")
        x = torch.randn(2, block_size, d_model, generator=g)
        with torch.no_grad():
            out = wrapper.eval()(x)
        expect(tuple(out.shape) == (2, block_size, d_out),
               f"{case}: the output has shape {tuple(out.shape)}, expected {(2, block_size, d_out)}")

    d_model, block_size, n_heads, d_out = 4, 6, 2, 3
    try:
        wrapper = wrapper_with_width(d_model, block_size, n_heads, d_out)
    except ValueError:
        return
    width = sum(head.head_dim for head in wrapper.heads) if isinstance(wrapper, MultiHeadAttentionWrapper) else "?"
    raise Wrong(f"wrapper_with_width(n_heads={n_heads}, d_out={d_out}) returned a module {width} wide: {d_out} "
                f"features cannot be split into {n_heads} heads of equal width; raise a ValueError naming both numbers")


# ---------------------------------------------------------------- 14.3

_GPT2 = dict(d_model=768, n_heads=12, block_size=1024)
_GPT2_COUNTS = {True: 4 * 768**2 + 4 * 768, False: 4 * 768**2 + 768}  # 2,362,368 and 2,360,064


@exercise("14.3")
def check_gpt2_attention(gpt2_attention) -> None:
    """Check ``gpt2_attention(qkv_bias)``: GPT-2 small's attention layer, with or without the q/k/v biases."""
    g = torch.Generator().manual_seed(1403)
    for qkv_bias in (True, False):
        case = f"gpt2_attention(qkv_bias={qkv_bias})"
        module = gpt2_attention(qkv_bias)
        if module is None:
            raise NotSolved("return an attnlib.MultiHeadAttention, not None")
        expect(isinstance(module, MultiHeadAttention),
               f"{case}: return an attnlib.MultiHeadAttention; got {type(module).__name__}")
        for name, value in _GPT2.items():
            got = getattr(module, name)
            expect(got == value, f"{case}: {name}={got}; GPT-2 small has {name}={value}")
        expect(module.causal, f"{case}: GPT-2's attention is causal (causal=True)")
        expect(isinstance(module.qkv, nn.Linear) and (module.qkv.in_features, module.qkv.out_features) == (768, 2304),
               f"{case}: qkv must be an nn.Linear(768, 2304): queries, keys and values of 12 heads of 64")
        expect(module.out_proj.bias is not None,
               f"{case}: out_proj has no bias. bias=False removes every bias; GPT-2 (and the source) keep the "
               "output projection's bias: build the module with biases, then replace .qkv")
        expect((module.qkv.bias is not None) == qkv_bias,
               f"{case}: qkv {'has' if module.qkv.bias is not None else 'has no'} bias; it should "
               f"{'have one' if qkv_bias else 'have none (replace .qkv with nn.Linear(768, 2304, bias=False))'}")
        n = sum(p.numel() for p in module.parameters())
        expect(n == _GPT2_COUNTS[qkv_bias], f"{case}: {n:,} parameters, expected {_GPT2_COUNTS[qkv_bias]:,}")

        x = torch.randn(1, 5, 768, generator=g)
        with torch.no_grad():
            q, k, v = (t.view(1, 5, 12, 64).transpose(1, 2) for t in module.qkv(x).split(768, dim=-1))  # 3 x (1, 12, 5, 64)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (1, 12, 5, 64)
            expected = module.out_proj(y.transpose(1, 2).reshape(1, 5, 768))  # -> (1, 5, 768)
            expect_close(module.eval()(x), expected, f"{case}: module(x) (compared with causal attention by hand)")


# ---------------------------------------------------------------- 14.4

_HF_CONFIG = GPTConfig(vocab_size=17, block_size=10, n_layers=2, n_heads=3, d_model=12, gelu_approximate="tanh")


def _reference_model(g: torch.Generator) -> GPT:
    """A small attnlib GPT-2 with every weight (biases and LayerNorms too) random, from ``g``."""
    model = GPT(_HF_CONFIG).eval()
    with torch.no_grad():  # GPT-2's init leaves biases at 0 and LayerNorms at 1: a lost one would go unnoticed
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "ln_" in name else 0.3))
    return model


def _hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """``model``'s weights in a Hugging Face GPT-2 checkpoint's names and layout, with its non-weight entries."""
    ours = model.state_dict()
    state = {}
    for name, (theirs, transpose) in hf_gpt2_key_map(_HF_CONFIG.n_layers).items():
        state[theirs] = (ours[name].t() if transpose else ours[name]).clone().contiguous()
    T = _HF_CONFIG.block_size
    for i in range(_HF_CONFIG.n_layers):  # the causal-mask buffers that OpenAI's converted checkpoint carries
        state[f"transformer.h.{i}.attn.bias"] = torch.ones(T, T).tril().view(1, 1, T, T)
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()  # the tied output head
    return state


@exercise("14.4")
def check_hf_key(hf_key) -> None:
    """Check ``hf_key(name, tensor)`` on every entry of a small GPT-2 checkpoint, then load the result and compare logits."""
    g = torch.Generator().manual_seed(1404)
    model = _reference_model(g)
    ours = model.state_dict()
    expected = {theirs: (name, transpose) for name, (theirs, transpose) in hf_gpt2_key_map(_HF_CONFIG.n_layers).items()}
    state = _hf_state_dict(model)
    answers = {hf_name: hf_key(hf_name, tensor.clone()) for hf_name, tensor in state.items()}
    if all(a is None for a in answers.values()):
        raise NotSolved("return (attnlib_name, tensor) for every weight; None only for what is not a weight")

    loaded = {}
    for hf_name, answer in answers.items():
        if hf_name.endswith((".attn.bias", ".attn.masked_bias")):
            expect(answer is None, f"{hf_name!r} is a causal-mask buffer of GPT-2's attention, not a weight: "
                                   "return None (attnlib builds its mask from the shapes)")
            continue
        if hf_name == "lm_head.weight" and answer is None:
            continue  # tied to the token embedding: skipping it is right
        expect(isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], str)
               and isinstance(answer[1], torch.Tensor),
               f"hf_key({hf_name!r}, ...) returned {type(answer).__name__}; return a pair (attnlib_name, tensor)")
        name, tensor = answer
        want_name, transpose = ("lm_head.weight", False) if hf_name == "lm_head.weight" else expected[hf_name]
        expect(name == want_name, f"{hf_name!r} maps to attnlib's {want_name!r}, not {name!r}")
        want = ours[want_name]
        if tuple(tensor.shape) != tuple(want.shape):
            if transpose and tuple(tensor.shape) == tuple(want.t().shape):
                raise Wrong(f"{hf_name!r} has shape {tuple(tensor.shape)}, attnlib's {name!r} is {tuple(want.shape)}: "
                            "Hugging Face's Conv1D stores its weight as (in_features, out_features), nn.Linear as "
                            "(out_features, in_features); transpose it")
            raise Wrong(f"{hf_name!r} gave a tensor of shape {tuple(tensor.shape)}; attnlib's {name!r} is "
                        f"{tuple(want.shape)}" + ("" if transpose else ": this one needs no transpose"))
        if transpose and torch.equal(tensor, want.t()):
            raise Wrong(f"{hf_name!r} is square {tuple(tensor.shape)}, so its shape cannot tell you whether to "
                        "transpose: every Conv1D weight (c_attn, c_proj, c_fc) is stored (in, out) and needs .t()")
        expect(bool(torch.equal(tensor, want)), f"{hf_name!r}: the tensor for {name!r} has the right shape but the "
                                                "wrong values")
        loaded[name] = tensor

    missing = sorted(set(ours) - set(loaded) - {"lm_head.weight"})
    expect(not missing, f"no entry produced attnlib's {missing[:3]}")
    loaded.setdefault("lm_head.weight", loaded["tok_emb.weight"])
    rebuilt = GPT(_HF_CONFIG).eval()
    rebuilt.load_state_dict(loaded)
    idx = torch.randint(0, _HF_CONFIG.vocab_size, (2, _HF_CONFIG.block_size), generator=g)
    with torch.no_grad():
        expect_close(rebuilt(idx)[0], model(idx)[0], "the logits of a GPT loaded with your mapping")


# ---------------------------------------------------------------- 14.5


# 14.5 lives in its own module (no module over 350 lines); importing it registers it.
from attnlib.book.exercises._ch14_init import check_gpt2_init  # noqa: E402
