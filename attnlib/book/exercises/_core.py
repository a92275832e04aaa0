"""The machinery behind the chapters' exercise checks.

A chapter's exercise cell calls a ``check_*`` function with the learner's
answer. The check prints one verdict line and never raises:

* ``Exercise 03.1: correct``
* ``Exercise 03.1: not solved yet: <what to do>`` (the stub still raises ``NotImplementedError`` or returns ``None``)
* ``Exercise 03.1: wrong: <hint>`` (the answer runs but gives the wrong result, or raises)
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Verdict", "Wrong", "EXERCISES", "exercise", "grade", "expect", "expect_close", "CORRECT", "NOT_SOLVED", "WRONG"]

CORRECT, NOT_SOLVED, WRONG = "correct", "not solved yet", "wrong"

#: exercise id (``"03.1"``) -> grader; filled by the ``@exercise`` decorator in each chapter module.
EXERCISES: dict[str, Callable[[Any], None]] = {}


class Wrong(Exception):
    """Raised by a grader when the answer runs but is not right; the message is the hint shown."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of checking one exercise."""

    exercise: str
    status: str
    detail: str = ""

    def __str__(self) -> str:
        return f"Exercise {self.exercise}: {self.status}" + (f": {self.detail}" if self.detail else "")

    @property
    def correct(self) -> bool:
        return self.status == CORRECT


def grade(exercise_id: str, answer: Any) -> Verdict:
    """Run the grader of ``exercise_id`` on ``answer`` and return its :class:`Verdict` (never raises)."""
    if exercise_id not in EXERCISES:
        raise KeyError(f"no exercise {exercise_id!r}; known: {sorted(EXERCISES)}")
    if answer is None:
        return Verdict(exercise_id, NOT_SOLVED, "the answer is still None")
    try:
        # A check draws its own test inputs; forking the RNG keeps the notebook's random state as it was.
        with torch.random.fork_rng(devices=[]):
            EXERCISES[exercise_id](answer)
    except NotImplementedError as e:
        return Verdict(exercise_id, NOT_SOLVED, str(e) or "the stub still raises NotImplementedError")
    except Wrong as e:
        return Verdict(exercise_id, WRONG, str(e))
    except Exception as e:  # the learner's code raised: report it, never crash the notebook
        return Verdict(exercise_id, WRONG, f"your code raised {type(e).__name__}: {e}")
    return Verdict(exercise_id, CORRECT)


def exercise(exercise_id: str) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Register a grader and turn it into a check that prints the verdict.

    The grader takes the learner's answer, returns nothing when it is right and
    raises :class:`Wrong` (with a hint) when not.
    """

    def decorator(grader: Callable[[Any], None]) -> Callable[[Any], None]:
        if exercise_id in EXERCISES:
            raise ValueError(f"exercise {exercise_id!r} is registered twice")
        EXERCISES[exercise_id] = grader

        @functools.wraps(grader)
        def check(answer: Any) -> None:
            print(grade(exercise_id, answer))

        return check

    return decorator


def expect(condition: bool, hint: str) -> None:
    """Raise :class:`Wrong` with ``hint`` unless ``condition`` holds."""
    if not condition:
        raise Wrong(hint)


def expect_close(actual: Any, expected: torch.Tensor, what: str, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """Raise :class:`Wrong` unless ``actual`` is a tensor of ``expected``'s shape and close to it."""
    expect(isinstance(actual, torch.Tensor), f"{what} should be a torch.Tensor, got {type(actual).__name__}")
    expect(
        tuple(actual.shape) == tuple(expected.shape),
        f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}",
    )
    if expected.dtype == torch.bool or not expected.is_floating_point():
        expect(bool(torch.equal(actual, expected)), f"{what} differs from the expected values")
        return
    diff = (actual.detach().double() - expected.detach().double()).abs().max().item()
    expect(
        torch.allclose(actual.detach().double(), expected.detach().double(), atol=atol, rtol=rtol),
        f"{what} differs from the expected values (max abs difference {diff:.3g})",
    )
