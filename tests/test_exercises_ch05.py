"""Chapter 05 exercise graders: reference answers pass, plausible mistakes fail, stubs are 'not solved yet'."""
import math

import pytest
import torch

from attnlib.book.exercises import CORRECT, WRONG, grade

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


def test_05_1_reference_is_correct():
    assert grade("05.1", th_weights).status == CORRECT


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        (dict(mask_first=True), "NaN"),
        (dict(mask_first=True, fill=-1e9), "before mixing"),
        (dict(zero_masked=False), "NaN"),
        (dict(transpose=True), "mix[h, g]"),
        (dict(pre=False), "mix_logits was not applied"),
        (dict(post=False), "mix_weights was not applied"),
        (dict(scale=False), "sqrt(head_dim)"),
        (dict(bias=0.01), "masked key got a non-zero weight"),
    ],
    ids=["mask-then-mix", "finite-mask-then-mix", "empty-rows-nan", "transposed", "no-pre", "no-post", "no-scale",
         "bias"],
)
def test_05_1_mistakes_are_wrong(kwargs, hint):
    verdict = grade("05.1", lambda *args: th_weights(*args, **kwargs))
    assert verdict.status == WRONG
    assert hint in verdict.detail


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


def test_05_2_reference_is_correct():
    assert grade("05.2", leaking).status == CORRECT


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda m, t, T, d: leaking(m, t, T, d, atol=1e-3), "1e-6"),
        (lambda m, t, T, d: leaking(m, t, T, d, use_eval=False), "eval()"),
        (lambda m, t, T, d: leaking(m, t, T, d, one_at_a_time=False), "one position s at a time"),
        (lambda m, t, T, d: leaking(m, t, T, d, start=0), "positions <= t"),
        (lambda m, t, T, d: torch.zeros(T, dtype=torch.bool), "bias after the softmax"),
        (lambda m, t, T, d: leaking(m, t, T, d).tolist(), "torch.Tensor"),
        (lambda m, t, T, d: leaking(m, t, T, d).int(), "boolean"),
    ],
    ids=["loose", "no-eval", "cumulative", "past-included", "never", "list", "int"],
)
def test_05_2_mistakes_are_wrong(answer, hint):
    verdict = grade("05.2", answer)
    assert verdict.status == WRONG
    assert hint in verdict.detail


# 05.3 convex mixing ---------------------------------------------------------------------------

def convex(weights, mix_raw):
    return torch.einsum("bgij,fg->bfij", weights, torch.softmax(mix_raw, dim=-1))


def convex_manual_exp(weights, mix_raw):
    e = mix_raw.exp()
    return torch.einsum("bgij,fg->bfij", weights, e / e.sum(-1, keepdim=True))


def renormalised_raw(weights, mix_raw):
    u = torch.einsum("bgij,fg->bfij", weights, mix_raw)
    return u / u.sum(-1, keepdim=True).clamp_min(1e-9)


def test_05_3_reference_is_correct():
    assert grade("05.3", convex).status == CORRECT


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda w, r: torch.einsum("bgij,fg->bfij", w, torch.softmax(r, dim=0)), "rows should sum to 1"),
        (lambda w, r: convex(w, r.T), "mix_raw[h, g]"),
        (lambda w, r: torch.einsum("bgij,fg->bfij", w, r), "negative weights"),
        (convex_manual_exp, "not finite"),
        (renormalised_raw, "negative weights"),
        (lambda w, r: convex(w, r) + 0.01, "masked weight became non-zero"),
    ],
    ids=["softmax-dim0", "transposed", "raw", "manual-exp", "renormalised", "bias"],
)
def test_05_3_mistakes_are_wrong(answer, hint):
    verdict = grade("05.3", answer)
    assert verdict.status == WRONG
    assert hint in verdict.detail


# stubs ----------------------------------------------------------------------------------------

