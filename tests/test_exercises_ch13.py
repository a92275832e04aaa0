"""The chapter 13 exercise checks: a reference answer is correct, a plausible mistake is wrong, a stub is not solved."""
import math

import torch
from exercise_table import Answers

from attnlib.book.exercises import NOT_SOLVED, grade


# ---------------------------------------------------------------- 13.1
def bits_per_char(loss, n_tokens, n_chars):
    return loss * n_tokens / n_chars / math.log(2)


def bits_per_char_tensor(loss, n_tokens, n_chars):  # 0-dim tensors are numbers too
    return torch.tensor(loss, dtype=torch.float64) * n_tokens / n_chars / math.log(2)


def nats_per_char(loss, n_tokens, n_chars):
    return loss * n_tokens / n_chars


def bits_multiplied(loss, n_tokens, n_chars):
    return loss * n_tokens / n_chars * math.log(2)


def ratio_inverted(loss, n_tokens, n_chars):
    return loss * n_chars / n_tokens / math.log(2)


def bits_per_token(loss, n_tokens, n_chars):  # right for a character model only
    return loss / math.log(2)


def perplexity_per_char(loss, n_tokens, n_chars):
    return 2 ** bits_per_char(loss, n_tokens, n_chars)


def pair_returned(loss, n_tokens, n_chars):
    return bits_per_char(loss, n_tokens, n_chars), 2 ** bits_per_char(loss, n_tokens, n_chars)


def bits_stub(loss, n_tokens, n_chars):
    raise NotImplementedError("total nats / characters / ln 2")


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


def suspicious_at_or_below(steps, val_loss, floor_bits=1.0):  # <= where the rule says below
    for step, loss in zip(steps, val_loss):
        if loss <= floor_bits * math.log(2):
            return step
    return None


def suspicious_step_before(steps, val_loss, floor_bits=1.0):  # off by one evaluation, early
    step = first_suspicious_step(steps, val_loss, floor_bits)
    return None if step is None else steps[max(steps.index(step) - 1, 0)]


def suspicious_stub(steps, val_loss, floor_bits=1.0):
    raise NotImplementedError("convert the floor to nats and scan the curve")


# ---------------------------------------------------------------- 13.3
def _stats(xs, ddof=1):
    mean = sum(xs) / len(xs)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - ddof))


def seed_verdict(losses_a, losses_b, z=2.0):
    if len(losses_a) < 2 or len(losses_b) < 2:
        raise ValueError("need at least two seeds per variant")
    (ma, sa), (mb, sb) = _stats(losses_a), _stats(losses_b)
    se = math.sqrt(sa**2 / len(losses_a) + sb**2 / len(losses_b))
    if abs(ma - mb) <= z * se:
        return None
    return "a" if ma < mb else "b"


def seed_verdict_statistics(losses_a, losses_b, z=2.0):  # the same rule with the standard library
    import statistics

    if min(len(losses_a), len(losses_b)) < 2:
        raise ValueError("one seed")
    se = math.hypot(statistics.stdev(losses_a) / math.sqrt(len(losses_a)),
                    statistics.stdev(losses_b) / math.sqrt(len(losses_b)))
    diff = statistics.fmean(losses_a) - statistics.fmean(losses_b)
    return None if abs(diff) <= z * se else ("a" if diff < 0 else "b")


def seed_verdict_means_only(losses_a, losses_b, z=2.0):
    if len(losses_a) < 2 or len(losses_b) < 2:
        raise ValueError
    return "a" if sum(losses_a) / len(losses_a) < sum(losses_b) / len(losses_b) else "b"


def seed_verdict_swapped(losses_a, losses_b, z=2.0):
    v = seed_verdict(losses_a, losses_b, z)
    return {"a": "b", "b": "a", None: None}[v]


def seed_verdict_population_sd(losses_a, losses_b, z=2.0):
    if len(losses_a) < 2 or len(losses_b) < 2:
        raise ValueError
    (ma, sa), (mb, sb) = _stats(losses_a, ddof=0), _stats(losses_b, ddof=0)
    se = math.sqrt(sa**2 / len(losses_a) + sb**2 / len(losses_b))
    return None if abs(ma - mb) <= z * se else ("a" if ma < mb else "b")


def seed_verdict_sd_not_se(losses_a, losses_b, z=2.0):
    if len(losses_a) < 2 or len(losses_b) < 2:
        raise ValueError
    (ma, sa), (mb, sb) = _stats(losses_a), _stats(losses_b)
    return None if abs(ma - mb) <= z * math.sqrt(sa**2 + sb**2) else ("a" if ma < mb else "b")


def seed_verdict_no_sqrt(losses_a, losses_b, z=2.0):
    if len(losses_a) < 2 or len(losses_b) < 2:
        raise ValueError
    (ma, sa), (mb, sb) = _stats(losses_a), _stats(losses_b)
    se = sa**2 / len(losses_a) + sb**2 / len(losses_b)
    return None if abs(ma - mb) <= z * se else ("a" if ma < mb else "b")


def seed_verdict_three_seeds(losses_a, losses_b, z=2.0):  # right for the chapter's 3 seeds only
    if len(losses_a) < 2 or len(losses_b) < 2:
        raise ValueError
    (ma, sa), (mb, sb) = _stats(losses_a), _stats(losses_b)
    se = math.sqrt(sa**2 / 3 + sb**2 / 3)
    return None if abs(ma - mb) <= z * se else ("a" if ma < mb else "b")


def seed_verdict_fixed_z(losses_a, losses_b, z=2.0):
    return seed_verdict(losses_a, losses_b, 2.0)


def seed_verdict_ranges(losses_a, losses_b, z=2.0):
    if len(losses_a) < 2 or len(losses_b) < 2:
        raise ValueError
    if max(losses_a) < min(losses_b):
        return "a"
    if max(losses_b) < min(losses_a):
        return "b"
    return None


def seed_verdict_one_seed_ok(losses_a, losses_b, z=2.0):  # with one seed, falls back to the means
    if len(losses_a) < 2 or len(losses_b) < 2:
        return "a" if losses_a[0] < losses_b[0] else "b"
    return seed_verdict(losses_a, losses_b, z)


def seed_verdict_sorts_in_place(losses_a, losses_b, z=2.0):
    losses_a.sort()
    losses_b.sort()
    return seed_verdict(losses_a, losses_b, z)


def seed_verdict_bool(losses_a, losses_b, z=2.0):
    return seed_verdict(losses_a, losses_b, z) is not None


def seed_verdict_stub(losses_a, losses_b, z=2.0):
    raise NotImplementedError("compare the difference of the means with z standard errors")


def bits_per_char_via_log2(loss, n_tokens, n_chars):  # another way: e^loss per token, log2 of it
    return math.log2(math.exp(loss)) * n_tokens / n_chars


def suspicious_by_enumerate(steps, val_loss, floor_bits=1.0):  # another way: next() over the pairs
    floor = floor_bits * math.log(2)
    return next((s for s, v in zip(steps, val_loss) if v < floor), None)


class AlwaysEqual(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def suspicious_int_subclass(steps, val_loss, floor_bits=1.0):
    step = first_suspicious_step(steps, val_loss, floor_bits)
    return None if step is None else AlwaysEqual(step)


def suspicious_float_step(steps, val_loss, floor_bits=1.0):
    step = first_suspicious_step(steps, val_loss, floor_bits)
    return None if step is None else float(step)


def suspicious_memorised(steps, val_loss, floor_bits=1.0):  # the typed-in curves only
    return {(0, 100): 1000}.get(tuple(steps[:2])) if floor_bits == 1.0 else None


def test_stubs_are_not_solved():
    for exercise_id, stub in [("13.1", bits_stub), ("13.2", suspicious_stub), ("13.3", seed_verdict_stub)]:
        assert grade(exercise_id, stub).status == NOT_SOLVED


ANSWERS = {
    "13.1": Answers(
        correct=[bits_per_char, bits_per_char_via_log2],
        wrong=[
            (nats_per_char, "divide by ln 2"),
            (bits_multiplied, "you multiplied"),
            (ratio_inverted, "inverted the ratio"),
            (bits_per_token, "bits per *token*"),
            (perplexity_per_char, "perplexity per character"),
            (pair_returned, "should be a Python float"),
            (bits_per_char_tensor, "use .item()"),
        ],
    ),
    "13.2": Answers(
        correct=[first_suspicious_step, suspicious_by_enumerate],
        wrong=[
            (suspicious_in_bits_without_converting, "convert the floor to nats"),
            (suspicious_divides, "you divided"),
            (suspicious_index, "not its index"),
            (suspicious_false, "return None"),
            (suspicious_at_or_below, "not <="),
            (suspicious_step_before, "the first validation loss below"),
            (suspicious_last, "the first validation loss below"),
            (suspicious_int_subclass, "Python int"),
            (suspicious_float_step, "Python int"),
            (suspicious_memorised, "step"),
        ],
    ),
    "13.3": Answers(
        correct=[seed_verdict, seed_verdict_statistics],
        wrong=[
            (seed_verdict_means_only, "by the means alone"),
            (seed_verdict_swapped, "higher* loss"),
            (seed_verdict_population_sd, "divide by n - 1"),
            (seed_verdict_sd_not_se, "standard error s / sqrt(n)"),
            (seed_verdict_no_sqrt, "take the square root"),
            (seed_verdict_three_seeds, "not by a fixed 3"),
            (seed_verdict_fixed_z, "threshold z the caller passes"),
            (seed_verdict_ranges, "non-overlapping ranges"),
            (seed_verdict_one_seed_ok, "raise ValueError"),
            (seed_verdict_sorts_in_place, "changed the lists"),
            (seed_verdict_bool, "return 'a', 'b' or None"),
        ],
    ),
}


def test_the_source_run_is_caught_at_step_1000_with_a_one_bit_floor():
    from attnlib.book.exercises.ch13 import _SOURCE_CAUSAL, _STEPS_100

    assert first_suspicious_step(_STEPS_100, _SOURCE_CAUSAL, 1.0) == 1000
    assert suspicious_in_bits_without_converting(_STEPS_100, _SOURCE_CAUSAL, 1.0) == 900


