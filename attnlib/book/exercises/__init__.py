"""Checks for the chapters' exercises: ``from attnlib.book.exercises import ch03; ch03.check_padding_mask(fn)``.

Each check prints ``Exercise NN.k: correct`` / ``not solved yet: …`` / ``wrong: …``
(or ``checker error: …`` when the check itself fails, outside the learner's code) and never
raises. :func:`grade` returns the same verdict as a value (used by the tests and by
``python -m attnlib.book.exercises check NOTEBOOK``).
"""
import importlib

from attnlib.book.exercises._core import (
    CHAPTERS,
    CHECKER_ERROR,
    CORRECT,
    EXERCISES,
    NOT_SOLVED,
    WRONG,
    Verdict,
    grade,
    load_all,
)


def __getattr__(name: str):
    """``exercises.ch03`` imports chapter 03's checks on first use: one chapter's import error stays its own."""
    if name in CHAPTERS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CHAPTERS",
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
    "load_all",
]
