"""The chapter 12 exercise checks: a reference answer is correct, a plausible mistake is wrong, a stub is not solved."""
import math

import pytest
import torch

import attnlib.generation
import attnlib.generation.sampling
from attnlib import GPT, GPTConfig
from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, grade
from attnlib.generation import sample_next_token, top_k_filter, top_p_filter


# ---------------------------------------------------------------- 12.1
def _count(config, tied=True, biases=None, final_norm=True, pos_emb=True):
    d, L = config.d_model, config.n_layers
    bias = config.bias if biases is None else biases
    norm = (2 if bias else 1) * d  # a LayerNorm: weight, and bias when bias=True
    block = 2 * norm + 3 * d * d + d * d + 4 * d * d + 4 * d * d
    if bias:
        block += 3 * d + d + 4 * d + d
    n = config.vocab_size * d + L * block + (norm if final_norm else 0)
    n += config.block_size * d if pos_emb else 0
    return n + (0 if tied else config.vocab_size * d)


def gpt_param_count(config):
    return _count(config)


def gpt_param_count_untied(config):
    return _count(config, tied=False)


def gpt_param_count_always_bias(config):
    return _count(config, biases=True)


def gpt_param_count_no_final_norm(config):
    return _count(config, final_norm=False)


def gpt_param_count_by_building(config):
    return GPT(config).num_parameters()


def gpt_param_count_float(config):
    return float(_count(config))


def gpt_param_count_stub(config):
    raise NotImplementedError("add up the embeddings, n_layers blocks and the final LayerNorm")


# ---------------------------------------------------------------- 12.2
def top_k_by_hand(logits, k):
    k = min(k, logits.shape[-1])
    kth = logits.topk(k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_k_zeros(logits, k):
    k = min(k, logits.shape[-1])
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, 0.0)


def top_k_by_index(logits, k):  # drops tokens tied with the k-th value
    k = min(k, logits.shape[-1])
    out = torch.full_like(logits, float("-inf"))
    idx = logits.topk(k, dim=-1).indices
    return out.scatter(-1, idx, logits.gather(-1, idx))


def top_k_strict(logits, k):  # keeps only logits above the k-th: k - 1 tokens
    k = min(k, logits.shape[-1])
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits <= kth, float("-inf"))


def top_k_sorted(logits, k):  # returns the kept logits in sorted order
    k = min(k, logits.shape[-1])
    values = logits.sort(dim=-1, descending=True).values
    return values.masked_fill(torch.arange(logits.shape[-1]) >= k, float("-inf"))


def top_k_in_place(logits, k):
    k = min(k, logits.shape[-1])
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill_(logits < kth, float("-inf"))


def top_k_no_clamp(logits, k):
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_k_stub(logits, k):
    raise NotImplementedError("find the k-th largest logit of each row")


# ---------------------------------------------------------------- 12.3
def top_p_by_hand(logits, p):
    probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
    before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
    drop = (before >= p).scatter(-1, order, before >= p)
    return logits.masked_fill(drop, float("-inf"))


def top_p_drops_crossing(logits, p):  # keeps only tokens whose running sum stays <= p
    probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
    drop_sorted = probs.cumsum(dim=-1) > p
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def top_p_unsorted(logits, p):  # running sum in vocabulary order, not by probability
    probs = logits.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= p
    return logits.masked_fill(drop, float("-inf"))


def top_p_no_scatter(logits, p):  # forgets to map the mask back to vocabulary order
    probs, _ = logits.softmax(dim=-1).sort(dim=-1, descending=True)
    drop = (probs.cumsum(dim=-1) - probs) >= p
    return logits.masked_fill(drop, float("-inf"))


def top_p_one_too_many(logits, p):
    probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
    before = probs.cumsum(dim=-1) - probs
    drop = before - torch.cat([torch.zeros_like(probs[..., :1]), probs[..., :-1]], dim=-1) >= p
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def top_p_strict_before(logits, p):  # drops a token only when the tokens before it exceed p
    probs, order = logits.softmax(dim=-1).sort(dim=-1, descending=True)
    drop = probs.cumsum(dim=-1) - probs > p
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def top_p_stub(logits, p):
    raise NotImplementedError("sort the probabilities and keep the shortest prefix that reaches p")


@pytest.mark.parametrize(
    "exercise_id, answer, status",
    [
        ("12.1", gpt_param_count, CORRECT),
        ("12.1", gpt_param_count_untied, WRONG),
        ("12.1", gpt_param_count_always_bias, WRONG),
        ("12.1", gpt_param_count_no_final_norm, WRONG),
        ("12.1", gpt_param_count_by_building, WRONG),
        ("12.1", gpt_param_count_float, WRONG),
        ("12.1", gpt_param_count_stub, NOT_SOLVED),
        ("12.2", top_k_by_hand, CORRECT),
        ("12.2", top_k_zeros, WRONG),
        ("12.2", top_k_by_index, WRONG),
        ("12.2", top_k_strict, WRONG),
        ("12.2", top_k_sorted, WRONG),
        ("12.2", top_k_in_place, WRONG),
        ("12.2", top_k_no_clamp, WRONG),
        ("12.2", top_k_stub, NOT_SOLVED),
        ("12.3", top_p_by_hand, CORRECT),
        ("12.3", top_p_drops_crossing, WRONG),
        ("12.3", top_p_unsorted, WRONG),
        ("12.3", top_p_no_scatter, WRONG),
        ("12.3", top_p_one_too_many, WRONG),
        ("12.3", top_p_stub, NOT_SOLVED),
    ],
)
def test_verdicts(exercise_id, answer, status):
    verdict = grade(exercise_id, answer)
    assert verdict.status == status, str(verdict)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (gpt_param_count_untied, "lm_head is tied"),
        (gpt_param_count_always_bias, "bias=False"),
        (gpt_param_count_no_final_norm, "ln_f"),
        (gpt_param_count_by_building, "formula"),
    ],
)
def test_param_count_hints(answer, hint):
    assert hint in grade("12.1", answer).detail


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("12.2", top_k_zeros, "-inf"),
        ("12.2", top_k_by_index, "tied"),
        ("12.2", top_k_sorted, "vocabulary order"),
        ("12.2", top_k_strict, "one token too few"),
        ("12.2", top_k_in_place, "in place"),
        ("12.2", top_k_no_clamp, "raised"),
        ("12.3", top_p_drops_crossing, "always stays"),
        ("12.3", top_p_no_scatter, "vocabulary order"),
        ("12.3", top_p_one_too_many, "one token too many"),
        ("12.3", top_p_strict_before, "one token too many"),
    ],
)
def test_filter_hints(exercise_id, answer, hint):
    assert hint in grade(exercise_id, answer).detail


def top_k_calls_the_library(logits, k):  # the filter imported by name, as the chapter's notebook does
    return top_k_filter(logits, k)


def top_k_calls_the_module(logits, k):
    return attnlib.generation.sampling.top_k_filter(logits, k)


def top_k_calls_the_package(logits, k):  # the re-export: attnlib.generation.top_k_filter
    return attnlib.generation.top_k_filter(logits, k)


def top_p_calls_the_library(logits, p):
    return top_p_filter(logits, p)


def top_p_through_sample_next_token(logits, p):  # reaches top_p_filter inside the library
    sample_next_token(logits.reshape(-1, logits.shape[-1]), 1.0, top_p=p)
    return top_p_by_hand(logits, p)


@pytest.mark.parametrize(
    "exercise_id, answer",
    [
        ("12.2", top_k_calls_the_library),
        ("12.2", top_k_calls_the_module),
        ("12.2", top_k_calls_the_package),
        ("12.3", top_p_calls_the_library),
        ("12.3", top_p_through_sample_next_token),
    ],
)
def test_calling_the_library_is_refused(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG and "write the filter by hand" in verdict.detail, str(verdict)
    for module in (attnlib.generation.sampling, attnlib.generation):  # the patches are undone
        assert module.top_k_filter is top_k_filter and module.top_p_filter is top_p_filter
    assert globals()["top_k_filter"] is top_k_filter  # the patch is undone


def test_top_p_unsorted_hint():
    assert "sort the probabilities" in grade("12.3", top_p_unsorted).detail or \
        "not the right ones" in grade("12.3", top_p_unsorted).detail


def test_reference_count_matches_the_model():
    for config in [GPTConfig(), GPTConfig(bias=False), GPTConfig(vocab_size=7, n_layers=2, n_heads=2, d_model=8)]:
        assert gpt_param_count(config) == GPT(config).num_parameters()


# ---------------------------------------------------------------- 12.4
def min_p_filter(logits, p_min):
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p_min * probs.amax(dim=-1, keepdim=True), float("-inf"))


def min_p_in_logit_space(logits, p_min):  # the same rule: z >= z_max + ln p_min
    threshold = logits.amax(dim=-1, keepdim=True) + math.log(p_min)
    return torch.where(logits >= threshold, logits, torch.full_like(logits, float("-inf")))


def min_p_absolute(logits, p_min):
    return logits.masked_fill(torch.softmax(logits, dim=-1) < p_min, float("-inf"))


def min_p_on_logits(logits, p_min):
    return logits.masked_fill(logits < p_min * logits.amax(dim=-1, keepdim=True), float("-inf"))


def min_p_global_max(logits, p_min):
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p_min * probs.max(), float("-inf"))


def min_p_strict(logits, p_min):
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs <= p_min * probs.amax(dim=-1, keepdim=True), float("-inf"))


def min_p_returns_probs(logits, p_min):  # renormalised probabilities instead of filtered logits
    return torch.softmax(min_p_filter(logits, p_min), dim=-1).masked_fill(
        torch.isinf(min_p_filter(logits, p_min)), float("-inf"))


def min_p_in_place(logits, p_min):
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill_(probs < p_min * probs.amax(dim=-1, keepdim=True), float("-inf"))


def min_p_zeros(logits, p_min):
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p_min * probs.amax(dim=-1, keepdim=True), 0.0)


def min_p_library(logits, p_min):  # top-p is not min-p, and the library is refused anyway
    return top_p_filter(logits, 1 - p_min)


@pytest.mark.parametrize(
    "answer, status, hint",
    [
        (min_p_filter, CORRECT, ""),
        (min_p_in_logit_space, CORRECT, ""),
        (min_p_absolute, WRONG, "scales with the row's top probability"),
        (min_p_on_logits, WRONG, "compare probabilities"),
        (min_p_global_max, WRONG, "top probability of each row"),
        (min_p_strict, WRONG, "the most likely token must stay"),
        (min_p_returns_probs, WRONG, "changes the logits it keeps"),
        (min_p_in_place, WRONG, "in place"),
        (min_p_zeros, WRONG, "-inf"),
        (min_p_library, WRONG, "write the filter by hand"),
    ],
)
def test_min_p(answer, status, hint):
    verdict = grade("12.4", answer)
    assert verdict.status == status, str(verdict)
    assert hint in verdict.detail, str(verdict)


def test_min_p_stub():
    def stub(logits, p_min):
        raise NotImplementedError("keep p >= p_min * max p")

    assert grade("12.4", stub).status == NOT_SOLVED
