"""The chapter 12 exercise checks: a reference answer is correct, a plausible mistake is wrong, a stub is not solved."""
import math

import torch
from exercise_table import Answers

import attnlib.generation
import attnlib.generation.sampling
from attnlib import GPT, GPTConfig
from attnlib.book.exercises import NOT_SOLVED, grade
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
    if p >= 1:
        return logits.clone()
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


def min_p_through_transformers(logits, p_min):
    from transformers.generation.logits_process import MinPLogitsWarper

    flat = logits.reshape(-1, logits.shape[-1])
    return MinPLogitsWarper(p_min)(None, flat.clone()).reshape(logits.shape)


# ---------------------------------------------------------------- more answers for the tables
def gpt_param_count_by_shapes(config):  # another way: the shape of every tensor, multiplied out
    d, V, T = config.d_model, config.vocab_size, config.block_size
    b = config.bias
    norm = [(d,), (d,)] if b else [(d,)]
    linear = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
    block = norm * 2 + linear + ([(3 * d,), (d,), (4 * d,), (d,)] if b else [])
    shapes = [(V, d), (T, d)] + block * config.n_layers + norm
    return sum(math.prod(shape) for shape in shapes)


def gpt_param_count_on_meta(config):  # "without building the model" holds on the meta device too
    with torch.device("meta"):
        return GPT(config).num_parameters()


def gpt_param_count_from_layers(config):  # builds the pieces instead of the model
    d = config.d_model
    block = sum(p.numel() for m in (torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)) for p in m.parameters())
    return _count(config) if block else 0


class AlwaysEqual(int):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = int.__hash__


def gpt_param_count_int_subclass(config):
    return AlwaysEqual(0)


def gpt_param_count_tensor(config):
    return torch.tensor(_count(config))


def top_k_through_transformers(logits, k):
    from transformers.generation.logits_process import TopKLogitsWarper

    flat = logits.reshape(-1, logits.shape[-1])
    return TopKLogitsWarper(top_k=k)(None, flat.clone()).reshape(logits.shape)


def top_k_by_sorting(logits, k):  # another way: the k-th value from a descending sort
    k = min(k, logits.shape[-1])
    kth = logits.sort(dim=-1, descending=True).values[..., k - 1 : k]
    return torch.where(logits >= kth, logits, torch.full_like(logits, float("-inf")))


def top_k_returns_input(logits, k):  # returns the very logits when nothing is filtered
    if k >= logits.shape[-1]:
        return logits
    return top_k_by_hand(logits, k)


def top_k_float32(logits, k):
    return top_k_by_hand(logits.float(), k)


def top_p_through_transformers(logits, p):
    from transformers.generation.logits_process import TopPLogitsWarper

    flat = logits.reshape(-1, logits.shape[-1])
    return TopPLogitsWarper(top_p=p, min_tokens_to_keep=1)(None, flat.clone()).reshape(logits.shape)


def top_p_cumulative_before(logits, p):  # another way: the mass of the tokens ranked before each one
    probs = logits.double().softmax(-1)
    before = (probs[..., None, :] > probs[..., :, None]).to(probs.dtype) @ probs[..., None]  # (..., V, 1)
    return logits.masked_fill(before[..., 0] >= p, float("-inf"))


def top_p_view(logits, p):  # filters a view of the logits, changing them in place
    out = logits.view(logits.shape)
    return out.masked_fill_(torch.isinf(top_p_by_hand(logits, p)), float("-inf"))


def top_p_float32_sum_at_one(logits, p):  # the running sum in float32 reaches 1 early
    probs, order = logits.float().softmax(dim=-1).sort(dim=-1, descending=True)
    before = probs.cumsum(dim=-1) - probs
    drop = (before >= p).scatter(-1, order, before >= p)
    return logits.masked_fill(drop, float("-inf"))


def min_p_subclass(logits, p_min):
    class Filtered(torch.Tensor):
        pass

    return min_p_filter(logits, p_min).as_subclass(Filtered)


def test_stubs_are_not_solved():
    for exercise_id, stub in [("12.1", gpt_param_count_stub), ("12.2", top_k_stub), ("12.3", top_p_stub)]:
        assert grade(exercise_id, stub).status == NOT_SOLVED


ANSWERS = {
    "12.1": Answers(
        correct=[gpt_param_count, gpt_param_count_by_shapes],
        wrong=[
            (gpt_param_count_untied, "lm_head is tied"),
            (gpt_param_count_always_bias, "bias=False"),
            (gpt_param_count_no_final_norm, "ln_f"),
            (gpt_param_count_by_building, "formula"),
            (gpt_param_count_on_meta, "formula"),
            (gpt_param_count_from_layers, "any nn.Module"),
            (gpt_param_count_float, "Python int"),
            (gpt_param_count_int_subclass, "Python int"),
            (gpt_param_count_tensor, "Python int"),
        ],
    ),
    "12.2": Answers(
        correct=[top_k_by_hand, top_k_by_sorting],
        wrong=[
            (top_k_zeros, "-inf"),
            (top_k_by_index, "tied"),
            (top_k_sorted, "vocabulary order"),
            (top_k_strict, "one token too few"),
            (top_k_in_place, "in place"),
            (top_k_no_clamp, "raised"),
            (top_k_calls_the_library, "write the filter by hand"),
            (top_k_calls_the_module, "write the filter by hand"),
            (top_k_calls_the_package, "write the filter by hand"),
            (top_k_through_transformers, "transformers"),
            (top_k_returns_input, "return a new tensor"),
            (top_k_float32, "keep the dtype"),
        ],
    ),
    "12.3": Answers(
        correct=[top_p_by_hand, top_p_cumulative_before],
        wrong=[
            (top_p_drops_crossing, "always stays"),
            (top_p_no_scatter, "vocabulary order"),
            (top_p_one_too_many, "one token too many"),
            (top_p_strict_before, "one token too many"),
            (top_p_unsorted, "sort the probabilities"),
            (top_p_calls_the_library, "write the filter by hand"),
            (top_p_through_sample_next_token, "write the filter by hand"),
            (top_p_through_transformers, "transformers"),
            (top_p_view, "in place"),
            (top_p_float32_sum_at_one, "with p = 1 every token stays"),
        ],
    ),
    "12.4": Answers(
        correct=[min_p_filter, min_p_in_logit_space],
        wrong=[
            (min_p_absolute, "scales with the row's top probability"),
            (min_p_on_logits, "compare probabilities"),
            (min_p_global_max, "top probability of each row"),
            (min_p_strict, "the most likely token must stay"),
            (min_p_returns_probs, "changes the logits it keeps"),
            (min_p_in_place, "in place"),
            (min_p_zeros, "-inf"),
            (min_p_library, "write the filter by hand"),
            (min_p_through_transformers, "transformers"),
            (min_p_subclass, "should be a torch.Tensor"),
        ],
    ),
}
