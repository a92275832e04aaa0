"""The machinery behind the chapters' exercise checks.

A chapter's exercise cell calls a ``check_*`` function with the learner's
answer. The check prints one verdict line and never raises:

* ``Exercise 03.1: correct``
* ``Exercise 03.1: not solved yet: <what to do>`` (the stub still raises ``NotImplementedError`` or returns ``None``)
* ``Exercise 03.1: wrong: <hint>`` (the answer runs but gives the wrong result, or raises)
* ``Exercise 03.1: checker error: <...>`` (the check itself failed, outside the learner's code:
  a bug in attnlib's check, to report, not the learner's mistake)

An exception counts as the learner's only when the learner's code is on its traceback (a frame
of a function or class the answer is made of); one raised by the reference, the harness or
torch called from the harness is a checker error.

When the environment variable :data:`VERDICTS_ENV` names a file, :func:`grade` also appends
each verdict there as one JSON line: ``python -m attnlib.book.exercises check`` reads its
verdicts from that file, never from the text a notebook printed.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import pkgutil
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

import torch

__all__ = ["Verdict", "Wrong", "NotSolved", "EXERCISES", "exercise", "grade", "expect", "expect_close", "CORRECT", "NOT_SOLVED", "CHAPTERS", "load_all", "call_for_int",
           "expect_tensor", "expect_int", "expect_number", "case_rng", "randint", "SEED_ENV",
           "WRONG", "CHECKER_ERROR", "VERDICTS_ENV"]

CORRECT, NOT_SOLVED, WRONG, CHECKER_ERROR = "correct", "not solved yet", "wrong", "checker error"

#: Environment variable naming a JSON Lines file where :func:`grade` records every verdict.
VERDICTS_ENV = "ATTNLIB_EXERCISE_VERDICTS"

#: exercise id (``"03.1"``) -> grader; filled by the ``@exercise`` decorator in each chapter module.
EXERCISES: dict[str, Callable[[Any], None]] = {}
#: The chapter modules with checks; each is imported on first use (``grade("03.1", ...)`` imports ``ch03``).
CHAPTERS = tuple(sorted(m.name for m in pkgutil.iter_modules([str(resources.files("attnlib.book.exercises"))])
                        if m.name.startswith("ch") and m.name[2:].isdigit()))


def _load_chapter(exercise_id: str) -> None:
    """Import the module whose checks register ``exercise_id`` (``"03.1"`` -> ``ch03``), if there is one."""
    module = f"ch{exercise_id.split('.')[0]}"
    if module in CHAPTERS:
        importlib.import_module(f"attnlib.book.exercises.{module}")


def load_all() -> dict[str, Callable[[Any], None]]:
    """Import every chapter's checks and return :data:`EXERCISES` (all of them registered)."""
    for module in CHAPTERS:
        importlib.import_module(f"attnlib.book.exercises.{module}")
    return EXERCISES


class Wrong(Exception):
    """Raised by a grader when the answer runs but is not right; the message is the hint shown."""


class NotSolved(NotImplementedError):
    """Raised by a grader when the answer is still a stub (returns ``None``, changes nothing); the message says what to do."""


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


def _nested(code: types.CodeType) -> set[types.CodeType]:
    """``code`` and the code of every function or lambda defined inside it."""
    return {code}.union(*(_nested(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _learner_code(answer: Any, seen: set[int] | None = None) -> set[types.CodeType]:
    """The code objects ``answer`` is made of: its functions, methods and classes (and what they define inside)."""
    seen = set() if seen is None else seen
    if id(answer) in seen or len(seen) > 1000:
        return set()
    seen.add(id(answer))
    if isinstance(answer, functools.partial):
        return _learner_code(answer.func, seen)
    if isinstance(answer, (list, tuple, set, frozenset)):
        return set().union(*(_learner_code(a, seen) for a in answer))
    if isinstance(answer, dict):
        return set().union(*(_learner_code(a, seen) for a in answer.values()))
    if isinstance(answer, (staticmethod, classmethod, types.MethodType)):
        return _learner_code(answer.__func__, seen)
    if isinstance(answer, property):
        return set().union(*(_learner_code(f, seen) for f in (answer.fget, answer.fset) if f is not None))
    if isinstance(answer, types.FunctionType):
        return _nested(inspect.unwrap(answer).__code__)
    codes: set[types.CodeType] = set()
    for klass in (answer if inspect.isclass(answer) else type(answer)).__mro__:
        if klass.__module__.split(".")[0] in ("builtins", "torch", "attnlib", "typing", "abc"):
            continue  # the library's and Python's own classes are not the learner's code
        for value in vars(klass).values():
            if isinstance(value, (types.FunctionType, staticmethod, classmethod, property)):
                codes |= _learner_code(value, seen)
    return codes


def _raised_by_learner(error: BaseException, answer: Any) -> bool:
    """Whether the learner's code (the answer's functions or classes) is on ``error``'s traceback."""
    codes = _learner_code(answer)
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False


def _record(verdict: Verdict) -> Verdict:
    path = os.environ.get(VERDICTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(verdict)) + "\n")
    return verdict


def grade(exercise_id: str, answer: Any) -> Verdict:
    """Run the grader of ``exercise_id`` on ``answer`` and return its :class:`Verdict` (never raises).

    An exception with the learner's code on its traceback is the learner's (``not solved yet``
    for ``NotImplementedError``, else ``wrong: your code raised ...``); any other exception is
    the check's own failure (``checker error``). Also records the verdict (see :data:`VERDICTS_ENV`).

    Raises:
        KeyError: no exercise ``exercise_id``.
    """
    if isinstance(exercise_id, str) and exercise_id not in EXERCISES:
        _load_chapter(exercise_id)
    if exercise_id not in EXERCISES:
        raise KeyError(f"no exercise {exercise_id!r}; known: {sorted(load_all())}")
    if answer is None:
        return _record(Verdict(exercise_id, NOT_SOLVED, "the answer is still None"))
    from attnlib.book.exercises._guard import restore

    restore()  # a helper of the checks or a torch function replaced in an earlier cell is put back first
    try:
        # A check draws its own test inputs; forking the RNG keeps the notebook's random state as it was.
        with torch.random.fork_rng(devices=[]):
            EXERCISES[exercise_id](answer)
    except Wrong as e:
        return _record(Verdict(exercise_id, WRONG, str(e)))
    except NotSolved as e:
        return _record(Verdict(exercise_id, NOT_SOLVED, str(e)))
    except Exception as e:  # never crash the notebook: say whose code failed
        if not _raised_by_learner(e, answer):
            return _record(Verdict(exercise_id, CHECKER_ERROR, (
                f"the check itself failed with {type(e).__name__}: {e} (a bug in attnlib's check, "
                "not in your code: please report it)")))
        if isinstance(e, NotImplementedError):
            return _record(Verdict(exercise_id, NOT_SOLVED, str(e) or "the stub still raises NotImplementedError"))
        return _record(Verdict(exercise_id, WRONG, f"your code raised {type(e).__name__}: {e}"))
    return _record(Verdict(exercise_id, CORRECT))


def exercise(exercise_id: str) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Register a grader and turn it into a check that prints the verdict.

    The grader takes the learner's answer, returns nothing when it is right and
    raises :class:`Wrong` (with a hint) when not.
    """

    def decorator(grader: Callable[[Any], None]) -> Callable[[Any], None]:
        if exercise_id in EXERCISES:
            raise ValueError(f"exercise {exercise_id!r} is registered twice")
        EXERCISES[exercise_id] = grader
        from attnlib.book.exercises._guard import record

        record()  # the checks' helpers as imported, before any answer can replace them

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
    expect_tensor(actual, what)
    expect(
        tuple(actual.shape) == tuple(expected.shape),
        f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}",
    )
    if expected.dtype == torch.bool or not expected.is_floating_point():
        expect(bool(torch.equal(actual, expected)), f"{what} differs from the expected values")
        return
    if expected.numel() == 0:
        return
    diff = (actual.detach().double() - expected.detach().double()).abs().max().item()
    expect(
        torch.allclose(actual.detach().double(), expected.detach().double(), atol=atol, rtol=rtol),
        f"{what} differs from the expected values (max abs difference {diff:.3g})",
    )


def expect_tensor(actual: Any, what: str, shape: tuple[int, ...] | None = None,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Raise :class:`Wrong` unless ``actual`` is a plain ``torch.Tensor`` (or ``nn.Parameter``) of ``shape``/``dtype``.

    The type is checked exactly: a tensor subclass can redefine ``==``, ``allclose`` or ``__bool__``.
    """
    expect(type(actual) in (torch.Tensor, torch.nn.Parameter),
           f"{what} should be a torch.Tensor, got {type(actual).__module__}.{type(actual).__qualname__}"
           if isinstance(actual, torch.Tensor) else f"{what} should be a torch.Tensor, got {type(actual).__name__}")
    if shape is not None:
        expect(tuple(actual.shape) == tuple(shape), f"{what} has shape {tuple(actual.shape)}, expected {tuple(shape)}")
    if dtype is not None:
        expect(actual.dtype == dtype, f"{what} has dtype {actual.dtype}, expected {dtype}")
    return actual


def expect_int(actual: Any, what: str) -> int:
    """Raise :class:`Wrong` unless ``actual`` is exactly a Python ``int`` (not a bool, float, tensor or subclass)."""
    if actual is None:
        raise NotSolved(f"{what}: return an int, not None")
    expect(type(actual) is int, f"{what} should be a Python int, got {type(actual).__name__}"
           + (" (use int(...) if you computed a float or a tensor)" if isinstance(actual, (float, torch.Tensor)) else ""))
    return actual


def expect_number(actual: Any, what: str) -> float:
    """Raise :class:`Wrong` unless ``actual`` is exactly a Python ``int`` or ``float`` (finite); return it as a float."""
    if actual is None:
        raise NotSolved(f"{what}: return a number, not None")
    expect(type(actual) in (int, float), f"{what} should be a Python float, got {type(actual).__name__}"
           + (" (use .item() on a one-element tensor)" if isinstance(actual, torch.Tensor) else ""))
    expect(actual == actual and abs(actual) != float("inf"), f"{what} is {actual}, not a finite number")
    return float(actual)


#: Environment variable that fixes the seed of the checks' random cases (tests set it; a notebook draws fresh ones).
SEED_ENV = "ATTNLIB_EXERCISE_SEED"


def case_rng() -> torch.Generator:
    """A generator for a check's random cases: a fresh seed each time, or :data:`SEED_ENV`'s when set.

    Fresh cases each run mean an answer cannot memorise the check's inputs; every check also keeps
    its fixed edge cases.
    """
    seed = os.environ.get(SEED_ENV)
    return torch.Generator().manual_seed(int(seed) if seed else int.from_bytes(os.urandom(7), "little"))


def randint(g: torch.Generator, low: int, high: int) -> int:
    """A Python int drawn uniformly from ``[low, high]`` (both ends included) with ``g``."""
    return int(torch.randint(low, high + 1, (), generator=g))


def call_for_int(fn: Callable[..., Any], args: tuple, case: str, config: Any) -> int:
    """``fn(*args)`` for a learner's byte count: a Python int, or a hint that names the mistake.

    Two mistakes with a config are named: reading attnlib 1.x's names ``config.kv_heads`` /
    ``config.latent_dim`` (an ``AttributeError``: :class:`attnlib.DecoderConfig` resolves the values in
    use into ``config.n_kv_heads`` / ``config.kv_latent_dim``), and arithmetic on
    ``config.kv_latent_dim`` for a variant that has no latent (a ``TypeError`` on ``None``: it is
    ``None`` unless ``attention="mla"``; a dict of every variant's formula evaluates them all).
    """
    try:
        got = fn(*args)
    except AttributeError as e:
        renamed = {"kv_heads": "n_kv_heads", "latent_dim": "kv_latent_dim"}
        if getattr(e, "name", None) in renamed:
            expect(
                False,
                f"{case}: your code raised AttributeError: {e}. attnlib 2.0's config resolves the values its layers "
                f"use under the fields' own names: config.{renamed[e.name]}, not config.{e.name}",
            )
        raise
    except TypeError as e:
        if "NoneType" in str(e) and config.kv_latent_dim is None:
            expect(
                False,
                f"{case}: your code raised TypeError: {e}. config.kv_latent_dim is None for "
                f"attention={config.attention!r}: only MLA caches a latent. A dict of every variant's formula "
                "computes them all; compute only the one for config.attention",
            )
        raise
    if got is None:
        raise NotSolved("return the number of bytes as an int, not None")
    expect(
        type(got) is int,
        f"return a Python int; got {type(got).__name__} (use int(...) if you computed a float or a tensor)",
    )
    return got
