"""Checks for the chapters' exercises: ``from attnlib.book.exercises import ch03; ch03.check_padding_mask(fn)``.

Each check prints ``Exercise NN.k: correct`` / ``not solved yet: …`` / ``wrong: …``
(or ``checker error: …`` when the check itself fails, outside the learner's code) and never
raises. :func:`grade` returns the same verdict as a value (used by the tests and by
``python -m attnlib.book.exercises check NOTEBOOK``).
"""
from attnlib.book.exercises import (
    ch01,
    ch02,
    ch03,
    ch04,
    ch05,
    ch06,
    ch07,
    ch08,
    ch09,
    ch10,
    ch11,
    ch12,
    ch13,
    ch14,
    ch15,
)
from attnlib.book.exercises._core import CHECKER_ERROR, CORRECT, EXERCISES, NOT_SOLVED, WRONG, Verdict, grade

__all__ = [
    "CHECKER_ERROR",
    "CORRECT",
    "EXERCISES",
    "NOT_SOLVED",
    "WRONG",
    "Verdict",
    "ch01",
    "ch02",
    "ch03",
    "ch04",
    "ch05",
    "ch06",
    "ch07",
    "ch08",
    "ch09",
    "ch10",
    "ch11",
    "ch12",
    "ch13",
    "ch14",
    "ch15",
    "grade",
]
