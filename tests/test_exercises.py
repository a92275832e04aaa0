"""Every registered exercise check: an unanswered stub is 'not solved yet', and grading never raises or moves the RNG."""
from pathlib import Path

import pytest
import torch

from attnlib.book.exercises import NOT_SOLVED, WRONG, grade, load_all

EXERCISES = load_all()


def stub(*args, **kwargs):
    raise NotImplementedError("your code here")


def crashes(*args, **kwargs):
    raise RuntimeError("boom")


def draws_then_stops(*args, **kwargs):
    torch.rand(5)  # a learner's answer that samples from the global generator
    raise NotImplementedError("half done")


def test_every_chapter_registers_exercises():
    chapters = {exercise_id.split(".")[0] for exercise_id in EXERCISES}
    notebooks = {path.name[:2] for path in (Path(__file__).parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert len(notebooks) >= 18 and chapters == notebooks


@pytest.mark.parametrize("exercise_id", sorted(EXERCISES))
def test_stub_and_none_are_not_solved(exercise_id):
    assert grade(exercise_id, stub).status == NOT_SOLVED
    assert grade(exercise_id, None).status == NOT_SOLVED


@pytest.mark.parametrize("exercise_id", sorted(EXERCISES))
def test_grading_leaves_the_notebooks_random_state_alone(exercise_id):
    """grade() forks the RNG: neither the grader's draws nor the answer's move the notebook's generator."""
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    assert grade(exercise_id, draws_then_stops).status == NOT_SOLVED
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("exercise_id", sorted(EXERCISES))
def test_an_answer_that_raises_is_wrong_not_a_crash(exercise_id, capsys):
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    verdict = grade(exercise_id, crashes)
    assert verdict.status == WRONG and "RuntimeError: boom" in verdict.detail
    assert torch.equal(torch.rand(2), expected)


def test_check_functions_print_one_verdict_line(capsys):
    from attnlib.book.exercises import ch03

    ch03.check_document_mask(stub)
    assert capsys.readouterr().out.startswith("Exercise 03.1: not solved yet")


def test_unknown_exercise_id():
    with pytest.raises(KeyError, match="no exercise '99.1'"):
        grade("99.1", stub)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "solutions").glob("*_solutions.ipynb")),
                         ids=lambda p: p.name[:2])
def test_every_solution_is_stored_correct(path):
    """The stored outputs of a solutions notebook grade every exercise of its chapter correct, and nothing else."""
    import json
    import re

    text = "".join("".join(o.get("text", "")) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
                   if c["cell_type"] == "code" for o in c.get("outputs", []))
    verdicts = re.findall(r"Exercise (\d\d\.\d+): ([a-z ]+)", text)
    chapter = path.name[:2]
    assert {i for i, status in verdicts if status == "correct"} == {i for i in EXERCISES if i.startswith(chapter)}
    assert all(status == "correct" for _, status in verdicts), verdicts
