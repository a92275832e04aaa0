"""The chapter 05 exercise checks, table-driven (tests/exercise_table.py): each ANSWERS entry lists answers the
check must accept and plausible mistakes it must refuse with a hint that names them."""
import math

import torch
from exercise_table import Answers

# 05.1 talking-heads weights by hand -----------------------------------------------------------

def th_weights(q, k, mix_logits, mix_weights, mask=None, *, mask_first=False, fill=float("-inf"), scale=True,
               transpose=False, pre=True, post=True, zero_masked=True, bias=0.0):
    if transpose:
        mix_logits, mix_weights = mix_logits.T, mix_weights.T
    logits = torch.einsum("bhid,bhjd->bhij", q, k) / (math.sqrt(q.shape[-1]) if scale else 1.0)
    if mask is not None and mask_first:
        logits = logits.masked_fill(~mask, fill)
    if pre:
        logits = torch.einsum("bhij,gh->bgij", logits, mix_logits)
    if mask is not None and not mask_first:
        logits = logits.masked_fill(~mask, fill)
    weights = torch.softmax(logits, dim=-1)
    if mask is not None and zero_masked:
        weights = weights.masked_fill(~mask, 0.0)
    if post:
        weights = torch.einsum("bhij,gh->bgij", weights, mix_weights)
    return weights + bias


def th_weights_where(q, k, mix_logits, mix_weights, mask=None):  # another way: torch.where, finite fill after mixing
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
    logits = torch.einsum("bhij,gh->bgij", logits, mix_logits)
    if mask is None:
        return torch.einsum("bhij,gh->bgij", logits.softmax(-1), mix_weights)
    weights = torch.where(mask, logits, torch.finfo(logits.dtype).min).softmax(-1)
    weights = torch.where(mask, weights, 0.0)
    return torch.einsum("bhij,gh->bgij", weights, mix_weights)


def th_weights_library(q, k, mix_logits, mix_weights, mask=None):  # attnlib's layer, through its own import
    from attnlib.attention import TalkingHeadsAttention as TH

    B, h, T_k, d = k.shape
    layer = TH(h * d, h, block_size=max(T_k, q.shape[2]), causal=False)
    with torch.no_grad():
        layer.mix_logits.copy_(mix_logits)
        layer.mix_weights.copy_(mix_weights)
        return layer.attend(q, k, torch.zeros(B, h, T_k, 1), mask, is_causal=False, need_weights=True)[1]


def th_weights_causal_added(q, k, mix_logits, mix_weights, mask=None):  # adds a causal mask of its own
    T_q, T_k = q.shape[2], k.shape[2]
    own = torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q)
    return th_weights(q, k, mix_logits, mix_weights, own if mask is None else mask & own)


# 05.2 which positions leak --------------------------------------------------------------------

def leaking(module, t, T, d_model, atol=1e-6, use_eval=True, one_at_a_time=True, start=None):
    if use_eval:
        module.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, T, d_model, generator=g)
    out = torch.zeros(T, dtype=torch.bool)
    with torch.no_grad():
        base = module(x)[:, t]
        for s in range(t + 1 if start is None else start, T):
            changed = x.clone()
            if one_at_a_time:
                changed[:, s] = torch.randn(changed[:, s].shape, generator=g)
            else:
                changed[:, s:] = torch.randn(changed[:, s:].shape, generator=g)
            out[s] = (module(changed)[:, t] - base).abs().max().item() > atol
    return out


def leaking_by_gradient(module, t, T, d_model):  # another way: which inputs output t depends on, by autograd
    was_training = module.training
    module.eval()
    x = torch.randn(1, T, d_model, requires_grad=True)
    module(x)[0, t].abs().sum().backward()
    module.train(was_training)
    reach = x.grad[0].abs().amax(-1) > 0  # (T,)
    return reach & (torch.arange(T) > t)


# 05.3 convex mixing ---------------------------------------------------------------------------

def convex(weights, mix_raw):
    return torch.einsum("bgij,fg->bfij", weights, torch.softmax(mix_raw, dim=-1))


def convex_manual_exp(weights, mix_raw):
    e = mix_raw.exp()
    return torch.einsum("bgij,fg->bfij", weights, e / e.sum(-1, keepdim=True))


def renormalised_raw(weights, mix_raw):
    u = torch.einsum("bgij,fg->bfij", weights, mix_raw)
    return u / u.sum(-1, keepdim=True).clamp_min(1e-9)


def convex_shifted_exp(weights, mix_raw):  # another way: exp after subtracting the row maximum
    e = (mix_raw - mix_raw.amax(-1, keepdim=True)).exp()
    return torch.einsum("bgij,fg->bfij", weights, e / e.sum(-1, keepdim=True))


def convex_in_place(weights, mix_raw):  # right values, but overwrites the caller's mix_raw
    mix_raw.copy_(torch.softmax(mix_raw, dim=-1))
    return torch.einsum("bgij,fg->bfij", weights, mix_raw)


ANSWERS = {
    "05.1": Answers(
        correct=[th_weights, th_weights_where],
        wrong=[
            (lambda *a: th_weights(*a, mask_first=True), "NaN"),
            (lambda *a: th_weights(*a, mask_first=True, fill=-1e9), "before mixing"),
            (lambda *a: th_weights(*a, zero_masked=False), "NaN"),
            (lambda *a: th_weights(*a, transpose=True), "mix[h, g]"),
            (lambda *a: th_weights(*a, pre=False), "mix_logits was not applied"),
            (lambda *a: th_weights(*a, post=False), "mix_weights was not applied"),
            (lambda *a: th_weights(*a, scale=False), "sqrt(head_dim)"),
            (lambda *a: th_weights(*a, bias=0.01), "masked key got a non-zero weight"),
            (th_weights_library, "write the talking-heads weights yourself"),
            (th_weights_causal_added, "differs from attnlib's weights"),
        ],
    ),
    "05.2": Answers(
        correct=[leaking, leaking_by_gradient],
        wrong=[
            (lambda m, t, T, d: leaking(m, t, T, d, atol=1e-3), "1e-6"),
            (lambda m, t, T, d: leaking(m, t, T, d, use_eval=False), "eval()"),
            (lambda m, t, T, d: leaking(m, t, T, d, one_at_a_time=False), "one position s at a time"),
            (lambda m, t, T, d: leaking(m, t, T, d, start=0), "positions <= t"),
            (lambda m, t, T, d: torch.zeros(T, dtype=torch.bool), "bias after the softmax"),
            (lambda m, t, T, d: leaking(m, t, T, d).tolist(), "torch.Tensor"),
            (lambda m, t, T, d: leaking(m, t, T, d).int(), "boolean"),
            (lambda m, t, T, d: torch.arange(T) == t + 2, "a causal layer was reported as leaking"),
        ],
    ),
    "05.3": Answers(
        correct=[convex, convex_shifted_exp],
        wrong=[
            (lambda w, r: torch.einsum("bgij,fg->bfij", w, torch.softmax(r, dim=0)), "rows should sum to 1"),
            (lambda w, r: convex(w, r.T), "mix_raw[h, g]"),
            (lambda w, r: torch.einsum("bgij,fg->bfij", w, r), "negative weights"),
            (convex_manual_exp, "overflows"),
            (renormalised_raw, "negative weights"),
            (lambda w, r: convex(w, r) + 0.01, "masked weight became non-zero"),
            (convex_in_place, "in place"),
        ],
    ),
}
