"""Exercise checks for chapter 14 (exercises 3.1–3.3 of *LLMs from Scratch*, and GPT-2).

* 14.1 ``check_copy_head``: ``copy_head(src, dst)`` copies one attention head into another,
  between :class:`attnlib.SelfAttentionV1` (``nn.Parameter``) and :class:`attnlib.SelfAttentionV2`
  (``nn.Linear``) in either direction, so that ``dst(x) == src(x)`` and ``dst`` owns its weights.
* 14.2 ``check_can_win``: ``can_win(k)`` says which keys ``(T, 2)`` a head of width 2 can ever
  prefer: the corners of their convex hull (the chapter's width-1 argument, one dimension up).
* 14.3 ``check_count_parameters``: ``count_parameters(config)``, the parameters of
  :class:`attnlib.GPT` for GPT-2's layout at other sizes, GQA, ``d_ff``, no biases, an untied head
  or RoPE, counted from the sizes without building a model.
* 14.4 ``check_hf_key``: ``hf_key(name, tensor)`` maps one entry of a Hugging Face GPT-2
  state dict to attnlib's name and layout (``None`` for what is not a weight).
* 14.5 ``check_gpt2_init``: ``gpt2_init_(model)`` initialises an :class:`attnlib.GPT` in place as
  GPT-2 does (Radford et al. 2019, §2.3; ``transformers``' ``GPT2PreTrainedModel._init_weights``):
  N(0, 0.02) weights, the residual projections N(0, 0.02 / sqrt(2 n_layers)), zero biases,
  LayerNorms the identity; checked by the statistics of every tensor on two depths.

Every check calls the answer through :func:`~attnlib.book.exercises._run.run` and draws fresh
cases from :func:`~attnlib.book.exercises._core.case_rng` besides its fixed ones; ``grade`` runs it
inside ``torch.random.fork_rng``, so checking an answer never moves the notebook's global random
state.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from attnlib.attention import SelfAttentionV1, SelfAttentionV2
from attnlib.book.exercises._core import NotSolved, Wrong, case_rng, exercise, expect, expect_close, randint
from attnlib.book.exercises._run import Refuse, run
from attnlib.models import GPT, GPTConfig, from_hf_gpt2
from attnlib.models.hf_gpt2 import hf_gpt2_key_map

__all__ = [
    "check_copy_head",
    "check_can_win",
    "check_count_parameters",
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
    g = case_rng()
    fresh = [(kinds[0], kinds[1], randint(g, 2, 9), randint(g, 1, 9))
             for kinds in ((SelfAttentionV2, SelfAttentionV1), (SelfAttentionV1, SelfAttentionV2))]
    for src_kind, dst_kind, d_model, head_dim in _COPY_CASES + fresh:
        src = _random_head(src_kind, d_model, head_dim, g)
        dst = _random_head(dst_kind, d_model, head_dim, g)
        case = f"{src_kind.__name__} -> {dst_kind.__name__} (d_model={d_model}, head_dim={head_dim})"
        dst_before = {k: v.clone() for k, v in dst.state_dict().items()}
        # the very heads, so that a copy that shares src's memory shows (run() compares src before and after)
        run(copy_head, src, dst, what=f"copy_head(src, dst) for {case}", mutable=(1,), copy_args=False)
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


# ---------------------------------------------------------------- 14.2, 14.3
# In a module of their own (no module over 350 lines); importing it registers them.
from attnlib.book.exercises._ch14_count import check_can_win, check_count_parameters  # noqa: E402

# ---------------------------------------------------------------- 14.4

_HF_CONFIG = GPTConfig(vocab_size=17, block_size=10, n_layers=2, n_heads=3, d_model=12, gelu_approximate="tanh")


def _reference_model(g: torch.Generator, config: GPTConfig) -> GPT:
    """A small attnlib GPT-2 with every weight (biases and LayerNorms too) random, from ``g``."""
    model = GPT(config).eval()
    with torch.no_grad():  # GPT-2's init leaves biases at 0 and LayerNorms at 1: a lost one would go unnoticed
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "ln_" in name else 0.3))
    return model


def _hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """``model``'s weights in a Hugging Face GPT-2 checkpoint's names and layout, with its non-weight entries."""
    ours, config = model.state_dict(), model.config
    state = {}
    for name, (theirs, transpose) in hf_gpt2_key_map(config.n_layers).items():
        state[theirs] = (ours[name].t() if transpose else ours[name]).clone().contiguous()
    T = config.block_size
    for i in range(config.n_layers):  # the causal-mask buffers that OpenAI's converted checkpoint carries
        state[f"transformer.h.{i}.attn.bias"] = torch.ones(T, T).tril().view(1, 1, T, T)
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()  # the tied output head
    return state


#: 14.4 asks for the renaming rules written out: the library's key map and loader are refused
_OWN_RULES = Refuse("write the renaming rules yourself, not with hf_gpt2_key_map or from_hf_gpt2",
                    hf_gpt2_key_map, from_hf_gpt2)


@exercise("14.4")
def check_hf_key(hf_key) -> None:
    """Check ``hf_key(name, tensor)`` on every entry of a small GPT-2 checkpoint, then load the result and compare logits."""
    g = case_rng()
    config = _HF_CONFIG.replace(n_layers=randint(g, 1, 3))  # fresh depth and weights each run
    model = _reference_model(g, config)
    ours = model.state_dict()
    state = _hf_state_dict(model)
    answers = {hf_name: run(hf_key, hf_name, tensor, what=f"hf_key({hf_name!r}, ...)", refuse=_OWN_RULES)
               for hf_name, tensor in state.items()}
    expected = {theirs: (name, transpose) for name, (theirs, transpose) in hf_gpt2_key_map(config.n_layers).items()}
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
        expect(type(answer) is tuple and len(answer) == 2 and type(answer[0]) is str
               and type(answer[1]) in (torch.Tensor, nn.Parameter),
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
    rebuilt = GPT(config).eval()
    rebuilt.load_state_dict(loaded)
    idx = torch.randint(0, config.vocab_size, (2, config.block_size), generator=g)
    with torch.no_grad():
        expect_close(rebuilt(idx)[0], model(idx)[0], "the logits of a GPT loaded with your mapping")


# ---------------------------------------------------------------- 14.5


# 14.5 lives in its own module (no module over 350 lines); importing it registers it.
from attnlib.book.exercises._ch14_init import check_gpt2_init  # noqa: E402
