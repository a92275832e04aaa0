"""One way of testing an exercise check: a table of answers it must accept and mistakes it must refuse.

Each ``tests/test_exercises_chNN.py`` defines ``ANSWERS = {"NN.k": Answers(...), ...}``;
:mod:`test_exercise_tables` grades every entry of every chapter's table, and runs the generic
cheats (a memorised answer, an answer that changes its input, one that replaces the check's helpers,
one that walks the stack into the check, one with the wrong signature) against each exercise.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: the random cases of every check are drawn with these seeds in the tests (a notebook draws fresh ones)
SEEDS = (1, 2)


@dataclass
class Answers:
    """What the check of one exercise must accept and refuse.

    Attributes:
        correct: answers the check accepts; the first is the solution's way, the others differ from it
            (another correct way a learner may write).
        wrong: ``(answer, phrase)``: a plausible mistake and a phrase the hint must contain, the phrase
            naming the mistake (not only "differs from the expected values").
        function: the answer is a function of the check's inputs (the generic cheats wrap it);
            ``False`` for an answer that is a class, a number or a module.
        memorisable: why the check has no random cases, when it cannot have any; ``None`` otherwise.
        changes_input: the exercise asks the answer to fill an argument in place (a cache).
    """

    correct: list[Any]
    wrong: list[tuple[Any, str]]
    function: bool = True
    memorisable: str | None = None
    changes_input: bool = False
    extra: dict[str, Callable[..., Any]] = field(default_factory=dict)
