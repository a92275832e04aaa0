"""The chapter 14 exercise checks: a reference answer is correct, plausible mistakes are wrong, a stub is not solved."""
import pytest
import torch
from torch import nn

from attnlib import MultiHeadAttention, MultiHeadAttentionWrapper, SelfAttentionV1
from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, grade
from attnlib.gpt2 import hf_gpt2_key_map


def stub(*args, **kwargs):
    raise NotImplementedError("your code here")


# ---------------------------------------------------------------- 14.1
def _linear_or_matrix(head, name):
    p = getattr(head, name)
    return p.weight if isinstance(p, nn.Linear) else p


def copy_head(src, dst):
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            source = _linear_or_matrix(src, name)
            _linear_or_matrix(dst, name).copy_(source.T)  # V1 stores (d_model, head_dim), nn.Linear the transpose


def copy_head_shared(src, dst):
    """The source's answer: nn.Parameter(weight.T) works, but the new parameter is a view of src's weight."""
    for name in ("W_query", "W_key", "W_value"):
        if isinstance(dst, SelfAttentionV1):
            setattr(dst, name, nn.Parameter(getattr(src, name).weight.T))
        else:
            getattr(dst, name).weight = nn.Parameter(getattr(src, name).T)


def copy_head_no_transpose(src, dst):
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            source = _linear_or_matrix(src, name)
            target = _linear_or_matrix(dst, name)
            target.copy_(source if source.shape == target.shape else source.T)  # transposes only when forced


def copy_head_reshape(src, dst):
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            target = _linear_or_matrix(dst, name)
            target.copy_(_linear_or_matrix(src, name).reshape(target.shape))


def copy_head_nothing(src, dst):
    pass


# ---------------------------------------------------------------- 14.2
def wrapper_with_width(d_model, block_size, n_heads, d_out):
    if d_out % n_heads:
        raise ValueError(f"d_out={d_out} is not divisible by n_heads={n_heads}")
    return MultiHeadAttentionWrapper(d_model, d_out // n_heads, block_size, n_heads)


def wrapper_head_dim_d_out(d_model, block_size, n_heads, d_out):
    return MultiHeadAttentionWrapper(d_model, d_out, block_size, n_heads)


def wrapper_no_check(d_model, block_size, n_heads, d_out):
    return MultiHeadAttentionWrapper(d_model, d_out // n_heads, block_size, n_heads)


def wrapper_one_head(d_model, block_size, n_heads, d_out):
    if d_out % n_heads:
        raise ValueError("not divisible")
    return MultiHeadAttentionWrapper(d_model, d_out, block_size, 1)


# ---------------------------------------------------------------- 14.3
def gpt2_attention(qkv_bias):
    module = MultiHeadAttention(768, 12, block_size=1024)
    if not qkv_bias:
        module.qkv = nn.Linear(768, 3 * 768, bias=False)
    return module


def gpt2_attention_all_bias_off(qkv_bias):
    return MultiHeadAttention(768, 12, block_size=1024, bias=qkv_bias)


def gpt2_attention_no_block_size(qkv_bias):
    module = MultiHeadAttention(768, 12)
    if not qkv_bias:
        module.qkv = nn.Linear(768, 3 * 768, bias=False)
    return module


def gpt2_attention_8_heads(qkv_bias):
    module = MultiHeadAttention(768, 8, block_size=1024)
    if not qkv_bias:
        module.qkv = nn.Linear(768, 3 * 768, bias=False)
    return module


# ---------------------------------------------------------------- 14.4
def _inverse_map(n_layers=2):
    return {theirs: (ours, transpose) for ours, (theirs, transpose) in hf_gpt2_key_map(n_layers).items()}


def hf_key(name, tensor):
    if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
        return None
    ours, transpose = _inverse_map()[name]
    return ours, tensor.t() if transpose else tensor


def hf_key_keeps_lm_head(name, tensor):
    if name == "lm_head.weight":
        return "lm_head.weight", tensor
    return hf_key(name, tensor)


def hf_key_transpose_when_needed(name, tensor):
    """Transposes only where the shape says so: misses the square attn.c_proj."""
    if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
        return None
    ours, transpose = _inverse_map()[name]
    square = tensor.dim() == 2 and tensor.shape[0] == tensor.shape[1]
    return ours, tensor.t() if transpose and not square else tensor


def hf_key_keeps_buffers(name, tensor):
    if name.endswith(".attn.bias"):
        return name.replace("transformer.h.", "blocks."), tensor
    return hf_key(name, tensor)


def hf_key_transposes_everything(name, tensor):
    answer = hf_key(name, tensor)
    return None if answer is None else (answer[0], tensor.t() if tensor.dim() == 2 else tensor)


def hf_key_no_transpose(name, tensor):
    answer = hf_key(name, tensor)
    return None if answer is None else (answer[0], tensor)


CASES = {
    "14.1": (copy_head, [copy_head_shared, copy_head_no_transpose, copy_head_reshape]),
    "14.2": (wrapper_with_width, [wrapper_head_dim_d_out, wrapper_no_check, wrapper_one_head]),
    "14.3": (gpt2_attention, [gpt2_attention_all_bias_off, gpt2_attention_no_block_size, gpt2_attention_8_heads]),
    "14.4": (hf_key, [hf_key_transpose_when_needed, hf_key_keeps_buffers, hf_key_transposes_everything,
                      hf_key_no_transpose]),
}


@pytest.mark.parametrize("exercise_id", sorted(CASES))
def test_reference_answer_is_correct(exercise_id):
    verdict = grade(exercise_id, CASES[exercise_id][0])
    assert verdict.status == CORRECT, verdict


@pytest.mark.parametrize(
    "exercise_id, answer", [(exercise_id, wrong) for exercise_id, (_, wrongs) in CASES.items() for wrong in wrongs],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_plausible_mistake_is_wrong(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, verdict
    assert "raised" not in verdict.detail, verdict  # a hint, not a crash report


def test_hints_name_the_mistake():
    assert "shares memory" in grade("14.1", copy_head_shared).detail
    assert "without a transpose" in grade("14.1", copy_head_no_transpose).detail
    assert "reshaped instead of transposed" in grade("14.1", copy_head_reshape).detail
    assert grade("14.1", copy_head_nothing).status == NOT_SOLVED
    assert "head_dim = d_out // n_heads" in grade("14.2", wrapper_head_dim_d_out).detail
    assert "raise a ValueError" in grade("14.2", wrapper_no_check).detail
    assert "out_proj has no bias" in grade("14.3", gpt2_attention_all_bias_off).detail
    assert "block_size=None" in grade("14.3", gpt2_attention_no_block_size).detail
    assert "square" in grade("14.4", hf_key_transpose_when_needed).detail
    assert "causal-mask buffer" in grade("14.4", hf_key_keeps_buffers).detail
    assert "needs no transpose" in grade("14.4", hf_key_transposes_everything).detail
    assert "Conv1D" in grade("14.4", hf_key_no_transpose).detail


def test_lm_head_may_be_skipped_or_mapped():
    assert grade("14.4", hf_key_keeps_lm_head).status == CORRECT


