"""The chapter 19 exercise checks: the solution is correct, plausible mistakes are wrong with a hint naming them."""
import pytest
import torch

from attnlib.book.exercises import CORRECT, NOT_SOLVED, WRONG, ch19, grade  # noqa: F401  (ch19 registers 19.x)


# ---------------------------------------------------------------- 19.1
def positions_from_mask(mask):
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def positions_in_place(mask):
    out = positions_from_mask(mask)
    mask.fill_(True)
    return out


# ---------------------------------------------------------------- 19.2
def expected_tokens(alpha, k):
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def simulated_tokens(alpha, k):  # right in the mean, but a noisy estimate
    accepted = (torch.rand(2000, k) < alpha).long().cumprod(-1).sum(-1)
    return (accepted + 1).double().mean().item()


# ---------------------------------------------------------------- 19.3
def pages_needed(prompt_lengths, new_tokens, page_size):
    return sum(-(-(p + n) // page_size) for p, n in zip(prompt_lengths, new_tokens))


# ---------------------------------------------------------------- 19.4
def residual(p, q):
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-300), p)


CORRECT_ANSWERS = [
    ("19.1", positions_from_mask),
    ("19.1", lambda m: torch.arange(m.shape[1]) - (~m).sum(-1, keepdim=True)
     + (~m).long() * ((~m).sum(-1, keepdim=True) - torch.arange(m.shape[1]))),
    ("19.2", expected_tokens),
    ("19.2", lambda a, k: sum(a**j for j in range(k + 1))),
    ("19.3", pages_needed),
    ("19.4", residual),
]


@pytest.mark.parametrize("exercise_id, answer", CORRECT_ANSWERS)
def test_reference_answer_is_correct(exercise_id, answer):
    verdict = grade(exercise_id, answer)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize(
    "exercise_id, answer, hint",
    [
        ("19.1", lambda m: torch.arange(m.shape[1]).expand(m.shape), "count the pads"),
        ("19.1", lambda m: m.long().cumsum(-1), "start at 1"),
        ("19.1", lambda m: m.long().cumsum(-1) - 1, "clamp the pads' positions at 0"),
        ("19.1", lambda m: m.long().flip(-1).cumsum(-1).flip(-1) - 1, "not back from the last"),
        ("19.1", lambda m: (m.cumsum(-1) - 1).clamp(min=0).float(), "integer tensor"),
        ("19.1", positions_in_place, "changed the mask in place"),
        ("19.2", lambda a, k: (1 - a**k) / (1 - a) if a < 1 else float(k), "the target's own token"),
        ("19.2", lambda a, k: 1 + a * k, "not accepted independently"),
        ("19.2", lambda a, k: 1 / (1 - a) if a < 1 else float(k + 1), "infinitely many drafts"),
        ("19.2", lambda a, k: (1 - a ** (k + 1)) / (1 - a), "without dividing by 1 - alpha"),
        ("19.2", lambda a, k: (1 - a ** (k + 1)) / (1 - a) if a < 1 else float("nan"), "returned nan"),
        ("19.2", simulated_tokens, "expected"),
        ("19.3", lambda ps, ns, s: -(-sum(p + n for p, n in zip(ps, ns)) // s), "you rounded the total"),
        ("19.3", lambda ps, ns, s: sum((p + n) // s for p, n in zip(ps, ns)), "round up"),
        ("19.3", lambda ps, ns, s: sum((p + n) // s + 1 for p, n in zip(ps, ns)), "not m + 1"),
        ("19.3", lambda ps, ns, s: sum(-(-p // s) - (n // -s) for p, n in zip(ps, ns)), "together"),
        ("19.3", lambda ps, ns, s: sum(-(-p // s) for p in ps), "count the new tokens"),
        ("19.3", lambda ps, ns, s: float(pages_needed(ps, ns, s)), "Python int"),
        ("19.4", lambda p, q: residual(q, p), "not q - p"),
        ("19.4", lambda p, q: (p - q).clamp(min=0), "divide by its sum"),
        ("19.4", lambda p, q: (p - q).softmax(-1), "clip p - q at zero"),
        ("19.4", lambda p, q: (p - q).clamp(min=0) / (p - q).clamp(min=0).sum(-1, keepdim=True), "not nan"),
    ],
)
def test_plausible_mistake_is_wrong(exercise_id, answer, hint):
    verdict = grade(exercise_id, answer)
    assert verdict.status == WRONG, str(verdict)
    assert hint in verdict.detail, str(verdict)


@pytest.mark.parametrize("exercise_id", ["19.1", "19.2", "19.3", "19.4"])
def test_stub_is_not_solved(exercise_id):
    def stub(*args):
        raise NotImplementedError("write it")

    assert grade(exercise_id, stub).status == NOT_SOLVED
