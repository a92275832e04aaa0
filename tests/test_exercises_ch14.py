"""The chapter 14 exercise checks: a reference answer is correct, plausible mistakes are wrong, a stub is not solved."""
import math

import pytest
import torch
from torch import nn

from attnlib import MultiHeadAttention, MultiHeadAttentionWrapper, SelfAttentionV1
from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, grade
from attnlib.models.hf_gpt2 import hf_gpt2_key_map


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


# ---------------------------------------------------------------- 14.5
RESIDUAL = ("attn.out_proj.weight", "mlp.proj.weight")


def _gpt2_like_init(model, residual_std, other_std, ln_weight=1.0, draw="normal"):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(ln_weight if ("ln_" in name and name.endswith("weight")) else 0.0)
                continue
            std = residual_std if name.endswith(RESIDUAL) else other_std(name)
            if draw == "normal":
                p.normal_(0.0, std)
            else:
                p.uniform_(-std * 3**0.5, std * 3**0.5)  # the same std, not a normal


def gpt2_init_(model):
    _gpt2_like_init(model, 0.02 / math.sqrt(2 * model.config.n_layers), lambda name: 0.02)


def gpt2_init_unscaled(model):
    _gpt2_like_init(model, 0.02, lambda name: 0.02)


def gpt2_init_sqrt_n_layers(model):
    _gpt2_like_init(model, 0.02 / math.sqrt(model.config.n_layers), lambda name: 0.02)


def gpt2_init_every_block_scaled(model):
    scaled = 0.02 / math.sqrt(2 * model.config.n_layers)
    _gpt2_like_init(model, scaled, lambda name: scaled if name.startswith("blocks.") else 0.02)


def gpt2_init_layernorm_zero(model):
    _gpt2_like_init(model, 0.02 / math.sqrt(2 * model.config.n_layers), lambda name: 0.02,
                    ln_weight=0.0)


def gpt2_init_uniform(model):
    _gpt2_like_init(model, 0.02 / math.sqrt(2 * model.config.n_layers), lambda name: 0.02,
                    draw="uniform")


def gpt2_init_library(model):
    model.reset_parameters()


def gpt2_init_new_tensors(model):
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not model.lm_head:
            module.weight = nn.Parameter(torch.empty_like(module.weight))
    gpt2_init_(model)


CASES = {
    "14.1": (copy_head, [copy_head_shared, copy_head_no_transpose, copy_head_reshape]),
    "14.2": (wrapper_with_width, [wrapper_head_dim_d_out, wrapper_no_check, wrapper_one_head]),
    "14.3": (gpt2_attention, [gpt2_attention_all_bias_off, gpt2_attention_no_block_size, gpt2_attention_8_heads]),
    "14.4": (hf_key, [hf_key_transpose_when_needed, hf_key_keeps_buffers, hf_key_transposes_everything,
                      hf_key_no_transpose]),
    "14.5": (gpt2_init_, [gpt2_init_unscaled, gpt2_init_sqrt_n_layers, gpt2_init_every_block_scaled,
                          gpt2_init_layernorm_zero, gpt2_init_uniform, gpt2_init_library,
                          gpt2_init_new_tensors]),
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
    assert "as every other weight" in grade("14.5", gpt2_init_unscaled).detail
    assert "N = 2 * n_layers" in grade("14.5", gpt2_init_sqrt_n_layers).detail
    assert "Only attn.out_proj and mlp.proj" in grade("14.5", gpt2_init_every_block_scaled).detail
    assert "LayerNorm starts as the identity" in grade("14.5", gpt2_init_layernorm_zero).detail
    assert "not a normal distribution" in grade("14.5", gpt2_init_uniform).detail
    assert "do not call GPT.reset_parameters" in grade("14.5", gpt2_init_library).detail
    assert "stay the same tensors" in grade("14.5", gpt2_init_new_tensors).detail
    assert grade("14.5", stub).status == NOT_SOLVED


def test_lm_head_may_be_skipped_or_mapped():
    assert grade("14.4", hf_key_keeps_lm_head).status == CORRECT


