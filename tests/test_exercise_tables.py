"""Every exercise check against its table (tests/test_exercises_chNN.py's ``ANSWERS``) and the generic cheats.

A table's correct answers are graded ``correct`` and its mistakes ``wrong`` with a hint that names
them, under two seeds of the check's random cases. Then each check must refuse, whatever the
exercise: an answer that memorised the cases it was shown, one that changes its input in place, one
that replaced the check's own helpers (in an earlier cell, or while it runs), one with the wrong
number of parameters; and the answer must not see the check's frames on its stack.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
from exercise_table import SEEDS, Answers

import attnlib.book.exercises._core as core
from attnlib.book.exercises import CORRECT, WRONG, grade, load_all

EXERCISES = load_all()
CHAPTERS = sorted({exercise_id.split(".")[0] for exercise_id in EXERCISES})
TABLES: dict[str, Answers] = {}
for chapter in CHAPTERS:
    module = importlib.import_module(f"test_exercises_ch{chapter}")
    TABLES.update(getattr(module, "ANSWERS", {}))
IDS = sorted(EXERCISES)
FUNCTIONS = [i for i in IDS if i in TABLES and TABLES[i].function]


def _grade(exercise_id, answer, seed, monkeypatch):
    monkeypatch.setenv(core.SEED_ENV, str(seed))
    return grade(exercise_id, answer)


@pytest.mark.parametrize("exercise_id", IDS)
def test_every_exercise_has_a_full_table(exercise_id):
    assert exercise_id in TABLES, f"tests/test_exercises_ch{exercise_id[:2]}.py has no ANSWERS[{exercise_id!r}]"
    answers = TABLES[exercise_id]
    assert len(answers.correct) >= 2, "the solution's way and at least one other correct answer"
    assert len(answers.wrong) >= 5, "at least five plausible mistakes"
    assert all(phrase.strip() for _, phrase in answers.wrong)


def _rows(kind):
    rows = []
    for exercise_id in IDS:
        answers = TABLES.get(exercise_id)
        if answers is None:
            continue
        items = answers.correct if kind == "correct" else answers.wrong
        for n, item in enumerate(items):
            rows.append(pytest.param(exercise_id, item, id=f"{exercise_id}-{kind}{n}"))
    return rows


@pytest.mark.parametrize("exercise_id, answer", _rows("correct"))
@pytest.mark.parametrize("seed", SEEDS)
def test_correct_answers_are_correct(exercise_id, answer, seed, monkeypatch):
    verdict = _grade(exercise_id, answer, seed, monkeypatch)
    assert verdict.status == CORRECT, str(verdict)


@pytest.mark.parametrize("exercise_id, item", _rows("wrong"))
def test_mistakes_are_wrong_with_their_hint(exercise_id, item, monkeypatch):
    answer, phrase = item
    for seed in SEEDS:
        verdict = _grade(exercise_id, answer, seed, monkeypatch)
        assert verdict.status == WRONG and phrase in verdict.detail, f"seed {seed}: {verdict}"


# --------------------------------------------------------------------------- generic cheats


def _key(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.detach().cpu().contiguous().numpy().tobytes())
    if isinstance(value, torch.nn.Module):
        return ("module", _key(dict(value.state_dict())))
    if isinstance(value, dict):
        return ("dict", tuple((k, _key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    return (type(value).__qualname__, repr(value))


@pytest.mark.parametrize("exercise_id", FUNCTIONS)
def test_a_memorised_answer_fails_on_fresh_cases(exercise_id, monkeypatch):
    answers = TABLES[exercise_id]
    if answers.memorisable:
        pytest.skip(answers.memorisable)
    correct, seen = answers.correct[0], {}

    def record(*args, **kwargs):
        out = correct(*args, **kwargs)
        seen[_key((args, kwargs))] = copy.deepcopy(out)
        return out

    def replay(*args, **kwargs):
        return copy.deepcopy(seen[_key((args, kwargs))])

    assert _grade(exercise_id, record, SEEDS[0], monkeypatch).status == CORRECT
    verdict = _grade(exercise_id, replay, SEEDS[1], monkeypatch)
    assert verdict.status != CORRECT, "the check's cases are the same every run: draw some from core.case_rng()"


@pytest.mark.parametrize("exercise_id", FUNCTIONS)
def test_an_answer_that_changes_its_input_is_told_so(exercise_id, monkeypatch):
    answers = TABLES[exercise_id]
    if answers.changes_input:
        pytest.skip("the exercise fills an argument in place")
    correct, changed = answers.correct[0], []

    def answer(*args, **kwargs):
        out = correct(*args, **kwargs)
        for arg in args:
            target = next(arg.parameters(), None) if isinstance(arg, torch.nn.Module) else arg
            if isinstance(target, torch.Tensor) and target.numel():
                with torch.no_grad():
                    target.logical_not_() if target.dtype == torch.bool else target.add_(1)
                changed.append(True)
                break
        return out

    verdict = _grade(exercise_id, answer, SEEDS[0], monkeypatch)
    if not changed:
        pytest.skip("the check passes the answer no tensor")
    assert verdict.status == WRONG and "in place" in verdict.detail, str(verdict)


def _noop(*args, **kwargs):
    return None


def _always(*args, **kwargs):
    return True


def _tamper(module):
    """Replace the checks' helpers and torch's comparisons with ones that always pass; return how to undo it."""
    saved = []
    for owner, name, new in [(core, "expect", _noop), (core, "expect_close", _noop), (module, "expect", _noop),
                             (module, "expect_close", _noop), (torch, "allclose", _always),
                             (torch, "equal", _always)]:
        if hasattr(owner, name):
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, new)
    return saved


def _untamper(saved):
    for owner, name, value in reversed(saved):
        setattr(owner, name, value)


@pytest.mark.parametrize("exercise_id", [i for i in IDS if i in TABLES])
def test_replacing_the_checks_helpers_in_an_earlier_cell_passes_nothing(exercise_id, monkeypatch):
    module = importlib.import_module(f"attnlib.book.exercises.ch{exercise_id[:2]}")
    wrong, phrase = TABLES[exercise_id].wrong[0]
    saved = _tamper(module)
    try:
        verdict = _grade(exercise_id, wrong, SEEDS[0], monkeypatch)
    finally:
        _untamper(saved)
    assert verdict.status == WRONG and phrase in verdict.detail, str(verdict)


@pytest.mark.parametrize("exercise_id", FUNCTIONS)
def test_replacing_the_checks_helpers_while_running_is_refused(exercise_id, monkeypatch):
    module = importlib.import_module(f"attnlib.book.exercises.ch{exercise_id[:2]}")
    wrong = TABLES[exercise_id].wrong[0][0]
    saved = []

    def answer(*args, **kwargs):
        if not saved:
            saved.extend(_tamper(module))
        return wrong(*args, **kwargs)

    try:
        verdict = _grade(exercise_id, answer, SEEDS[0], monkeypatch)
    finally:
        _untamper(saved)
    assert verdict.status == WRONG and "replaced the check's own" in verdict.detail, str(verdict)


CHECK_FILES = re.compile(r"exercises[/\\](ch\d\d|_core|_ch\d\d_\w+)\.py$")


@pytest.mark.parametrize("exercise_id", FUNCTIONS)
def test_the_answer_cannot_walk_into_the_checks_frames(exercise_id, monkeypatch):
    correct, files = TABLES[exercise_id].correct[0], []

    def answer(*args, **kwargs):
        files.extend(frame.filename for frame in inspect.stack(context=0))
        return correct(*args, **kwargs)

    assert _grade(exercise_id, answer, SEEDS[0], monkeypatch).status == CORRECT
    assert files and not [f for f in files if CHECK_FILES.search(f)], files


@pytest.mark.parametrize("exercise_id", FUNCTIONS)
def test_the_wrong_number_of_parameters_is_the_learners_mistake(exercise_id, monkeypatch):
    correct = TABLES[exercise_id].correct[0]
    parameters = list(inspect.signature(correct).parameters.values())
    if not parameters or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        pytest.skip("no fixed parameters to miss")
    names = ", ".join(p.name for p in parameters[:-1])
    namespace = {}
    exec(f"def short({names}):\n    raise AssertionError('never called')\n", namespace)
    verdict = _grade(exercise_id, namespace["short"], SEEDS[0], monkeypatch)
    assert verdict.status == WRONG and "signature" in verdict.detail, str(verdict)


def crashes(*args, **kwargs):
    raise RuntimeError("boom")


@pytest.mark.parametrize("exercise_id", IDS)
def test_the_learners_exception_names_its_line(exercise_id, monkeypatch):
    verdict = _grade(exercise_id, crashes, SEEDS[0], monkeypatch)
    assert verdict.status == WRONG and "RuntimeError: boom" in verdict.detail and "line" in verdict.detail, str(verdict)


def test_the_tables_cover_every_chapter():
    notebooks = {p.name[:2] for p in (Path(__file__).parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert set(CHAPTERS) == notebooks


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_has_at_least_three_exercises(chapter):
    assert sum(i.startswith(f"{chapter}.") for i in IDS) >= 3
