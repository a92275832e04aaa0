"""The chapter 13 exercise checks: a reference answer is correct, a plausible mistake is wrong, a stub is not solved."""
import math

import pytest
import torch

from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, grade


# ---------------------------------------------------------------- 13.1
def perplexity_and_bits(loss):
    return math.exp(loss), loss / math.log(2)


def perplexity_and_bits_tensor(loss):  # 0-dim tensors are numbers too
    loss = torch.tensor(loss, dtype=torch.float64)
    return loss.exp(), loss / math.log(2)


def perplexity_base_2(loss):
    return 2.0**loss, loss / math.log(2)


def bits_multiplied(loss):
    return math.exp(loss), loss * math.log(2)


def bits_log2(loss):
    return math.exp(loss), math.log2(loss) if loss > 0 else 0.0


def swapped(loss):
    return loss / math.log(2), math.exp(loss)


def only_perplexity(loss):
    return math.exp(loss)


def perplexity_stub(loss):
    raise NotImplementedError("perplexity = e^loss; bits = loss / ln 2")


# ---------------------------------------------------------------- 13.2
def first_suspicious_step(steps, val_loss, floor_bits=1.0):
    floor = floor_bits * math.log(2)
    for step, loss in zip(steps, val_loss):
        if loss < floor:
            return step
    return None


def suspicious_in_bits_without_converting(steps, val_loss, floor_bits=1.0):
    for step, loss in zip(steps, val_loss):
        if loss < floor_bits:
            return step
    return None


def suspicious_divides(steps, val_loss, floor_bits=1.0):
    for step, loss in zip(steps, val_loss):
        if loss < floor_bits / math.log(2):
            return step
    return None


def suspicious_index(steps, val_loss, floor_bits=1.0):
    for i, loss in enumerate(val_loss):
        if loss < floor_bits * math.log(2):
            return i
    return None


def suspicious_false(steps, val_loss, floor_bits=1.0):
    step = first_suspicious_step(steps, val_loss, floor_bits)
    return False if step is None else step


def suspicious_last(steps, val_loss, floor_bits=1.0):  # the last step below the floor, not the first
    below = [s for s, loss in zip(steps, val_loss) if loss < floor_bits * math.log(2)]
    return below[-1] if below else None


def suspicious_stub(steps, val_loss, floor_bits=1.0):
    raise NotImplementedError("convert the floor to nats and scan the curve")


# ---------------------------------------------------------------- 13.3
def kv_cache_bytes(results, variant, context_length, batch_size=1, dtype=torch.float32):
    per_token = results["variants"][variant]["kv_cache_bytes_per_token"]  # all layers, float32
    return per_token * context_length * batch_size * dtype.itemsize // 4


def kv_cache_times_layers(results, variant, context_length, batch_size=1, dtype=torch.float32):
    return kv_cache_bytes(results, variant, context_length, batch_size, dtype) * results["model"]["n_layers"]


def kv_cache_ignores_dtype(results, variant, context_length, batch_size=1, dtype=torch.float32):
    return results["variants"][variant]["kv_cache_bytes_per_token"] * context_length * batch_size


def kv_cache_times_itemsize(results, variant, context_length, batch_size=1, dtype=torch.float32):
    return results["variants"][variant]["kv_cache_bytes_per_token"] * context_length * batch_size * dtype.itemsize


def kv_cache_no_batch(results, variant, context_length, batch_size=1, dtype=torch.float32):
    return kv_cache_bytes(results, variant, context_length, 1, dtype)


def kv_cache_float(results, variant, context_length, batch_size=1, dtype=torch.float32):
    return kv_cache_bytes(results, variant, context_length, batch_size, dtype) / 1.0


def kv_cache_stub(results, variant, context_length, batch_size=1, dtype=torch.float32):
    raise NotImplementedError("scale the per-token figure")


@pytest.mark.parametrize(
    "exercise_id, answer, status",
    [
        ("13.1", perplexity_and_bits, CORRECT),
        ("13.1", perplexity_and_bits_tensor, CORRECT),
        ("13.1", perplexity_base_2, WRONG),
        ("13.1", bits_multiplied, WRONG),
        ("13.1", bits_log2, WRONG),
        ("13.1", swapped, WRONG),
        ("13.1", only_perplexity, WRONG),
        ("13.1", perplexity_stub, NOT_SOLVED),
        ("13.2", first_suspicious_step, CORRECT),
        ("13.2", suspicious_in_bits_without_converting, WRONG),
        ("13.2", suspicious_divides, WRONG),
        ("13.2", suspicious_index, WRONG),
        ("13.2", suspicious_false, WRONG),
        ("13.2", suspicious_last, WRONG),
        ("13.2", suspicious_stub, NOT_SOLVED),
        ("13.3", kv_cache_bytes, CORRECT),
        ("13.3", kv_cache_times_layers, WRONG),
        ("13.3", kv_cache_ignores_dtype, WRONG),
        ("13.3", kv_cache_times_itemsize, WRONG),
        ("13.3", kv_cache_no_batch, WRONG),
        ("13.3", kv_cache_float, WRONG),
        ("13.3", kv_cache_stub, NOT_SOLVED),
    ],
)
def test_verdicts(exercise_id, answer, status):
    verdict = grade(exercise_id, answer)
    assert verdict.status == status, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("13.1", perplexity_base_2, "not 2^loss"),
        ("13.1", bits_multiplied, "you multiplied"),
        ("13.1", bits_log2, "not log2(loss)"),
        ("13.1", swapped, "in that order"),
        ("13.1", only_perplexity, "return a pair"),
        ("13.2", suspicious_in_bits_without_converting, "convert the floor to nats"),
        ("13.2", suspicious_divides, "you divided"),
        ("13.2", suspicious_index, "not its index"),
        ("13.2", suspicious_false, "return None"),
        ("13.3", kv_cache_times_layers, "already counts all"),
        ("13.3", kv_cache_ignores_dtype, "is for float32"),
        ("13.3", kv_cache_times_itemsize, "already in bytes"),
        ("13.3", kv_cache_no_batch, "multiply by batch_size"),
        ("13.3", kv_cache_float, "as an int"),
    ],
)
def test_hints(exercise_id, answer, hint):
    assert hint in grade(exercise_id, answer).detail


def test_the_source_run_is_caught_at_step_1000_with_a_one_bit_floor():
    from attnlib.book.exercises.ch13 import _SOURCE_CAUSAL, _STEPS_100

    assert first_suspicious_step(_STEPS_100, _SOURCE_CAUSAL, 1.0) == 1000
    assert suspicious_in_bits_without_converting(_STEPS_100, _SOURCE_CAUSAL, 1.0) == 900


