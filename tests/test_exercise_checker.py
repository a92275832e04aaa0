"""`python -m attnlib.book.exercises check`: verdicts come from running the checks, bad input exits 2.

Tests that execute a whole chapter notebook in a kernel are left to nbval (which runs every
notebook) and to tests/test_install.py (a solutions notebook from an installed wheel); the
notebooks here are a few cells each.
"""
import json
import re
import subprocess
import sys

import nbformat
import pytest

from attnlib.book.exercises import CHECKER_ERROR, EXERCISES, NOT_SOLVED, WRONG, grade
from attnlib.book.exercises.__main__ import NOT_CHECKED, check_notebook, main, read_notebook
from attnlib.book.exercises._core import VERDICTS_ENV, exercise


def notebook(tmp_path, *cells, name="mine.ipynb"):
    """A notebook of markdown (str starting with '#md ') and code cells, written to tmp_path."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(c[4:]) if c.startswith("#md ") else nbformat.v4.new_code_cell(c)
                for c in cells]
    path = tmp_path / name
    nbformat.write(nb, path)
    return path


EX_03_1 = "#md ```{exercise-start}\n:label: ex-03-1\n```"
EX_03_2 = "#md ```{exercise-start}\n:label: ex-03-2\n```"
SOLVE_03_1 = ("import torch\nfrom attnlib.book.exercises import ch03\n"
              "def document_mask(doc_ids):\n"
              "    i = torch.arange(doc_ids.shape[1])\n"
              "    same = doc_ids[:, :, None] == doc_ids[:, None, :]\n"
              "    return (i[None, :] <= i[:, None]) & same & (doc_ids != -1)[:, None, :]\n"
              "ch03.check_document_mask(document_mask)")


def test_a_solved_exercise_is_correct_and_a_broken_one_wrong_or_not_checked(tmp_path):
    path = notebook(
        tmp_path, EX_03_1, SOLVE_03_1, EX_03_2, "raise RuntimeError('a learner typo')",
        "from attnlib.book.exercises import ch03\nch03.check_document_mask(lambda doc_ids: None + 1)",
    )
    rows = check_notebook(path)
    # 03.1 was checked twice: the last check counts (the learner's later, broken attempt)
    assert rows[0][:2] == ("03.1", WRONG) and "your code raised TypeError" in rows[0][2]
    assert rows[1][:2] == ("03.2", NOT_CHECKED)
    assert main(["check", str(path)]) == 1


def test_a_notebook_that_prints_a_verdict_proves_nothing(tmp_path, capsys):
    path = notebook(tmp_path, EX_03_1, "print('Exercise 03.1: correct')", "print('Exercise 03.2: correct')")
    assert check_notebook(path) == [("03.1", NOT_CHECKED, "no check ran for it (did an earlier cell fail?)")]
    assert main(["check", str(path)]) == 1
    assert "0 of 1 correct" in capsys.readouterr().out


def test_every_exercise_correct_exits_0(tmp_path, capsys):
    path = notebook(tmp_path, EX_03_1, SOLVE_03_1)
    assert main(["check", str(path)]) == 0
    assert "1 of 1 correct" in capsys.readouterr().out


def test_command_line_outside_the_checkout(tmp_path):
    path = notebook(tmp_path, EX_03_1, SOLVE_03_1)
    result = subprocess.run([sys.executable, "-m", "attnlib.book.exercises", "check", path.name],
                            capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "03.1" in result.stdout and "1 of 1 correct" in result.stdout


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no notebook at"),
        ("print('hello')\n", "not a Jupyter notebook (not JSON"),
        ("[1, 2]", "JSON without 'nbformat' and 'cells'"),
        ('{"cells": "nope", "nbformat": 4, "nbformat_minor": 5, "metadata": {}}', "not a valid Jupyter notebook"),
        (b"\xff\xfe\x00binary", "not a Jupyter notebook"),
    ],
)
def test_not_a_notebook_exits_2_with_an_argparse_error(tmp_path, capsys, content, message):
    path = tmp_path / "bad.ipynb"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["check", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m attnlib.book.exercises: error: argument notebook:" in err and message in err
    assert str(path) in err
    if content is not None:
        with pytest.raises(ValueError, match=re.escape(message)):
            read_notebook(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: command"),
        (["grade", "x.ipynb"], "invalid choice: 'grade'"),
        (["check"], "the following arguments are required: notebook"),
        (["check", "x.ipynb", "--timeout", "0"], "argument --timeout: 0 is not a positive integer"),
        (["check", "x.ipynb", "--timeout", "soon"], "argument --timeout: 'soon' is not an integer"),
        (["check", "x.ipynb", "--fast"], "unrecognized arguments: --fast"),
    ],
)
def test_bad_flags_exit_2_with_an_argparse_error(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("python -m attnlib.book.exercises") and "error:" in err
    assert message in err


def test_bad_file_from_the_command_line_is_one_error_line_not_a_traceback(tmp_path):
    (tmp_path / "notes.ipynb").write_text("# not JSON")
    result = subprocess.run([sys.executable, "-m", "attnlib.book.exercises", "check", "notes.ipynb"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith("python -m attnlib.book.exercises: error: argument notebook:")


# ------------------------------------------------------------- whose failure: the learner's or the checker's

@pytest.fixture
def harness_exercises():
    """Two throwaway exercises whose own reference code fails (registered only for the test)."""

    @exercise("99.1")
    def reference_crashes(fn):
        fn(2)  # the learner's code runs fine
        raise ZeroDivisionError("division by zero in the reference")

    @exercise("99.2")
    def harness_misuses_torch(fn):
        import torch

        torch.ones(2, 3) @ torch.ones(2, 3)  # the harness's own shape bug

    yield
    del EXERCISES["99.1"], EXERCISES["99.2"]


def learner_ok(n):
    return n


def learner_raises(n):
    raise IndexError("list index out of range in my loop")


def learner_helper_raises(n):
    return _learner_helper(n)


def _learner_helper(n):
    return [][n]


class LearnerModule:
    def __call__(self, n):
        return self.forward(n)

    def forward(self, n):
        raise KeyError("mine")


def test_an_exception_in_the_reference_or_harness_is_a_checker_error(harness_exercises):
    for exercise_id, error in (("99.1", "ZeroDivisionError"), ("99.2", "RuntimeError")):
        verdict = grade(exercise_id, learner_ok)
        assert verdict.status == CHECKER_ERROR, verdict
        assert error in verdict.detail and "not in your code" in verdict.detail and "your code raised" not in verdict.detail


def test_an_exception_in_the_learners_code_is_wrong(harness_exercises):
    for answer, error in ((learner_raises, "IndexError"), (learner_helper_raises, "IndexError"),
                          (LearnerModule(), "KeyError"), (lambda n: n.nope, "AttributeError")):
        verdict = grade("99.1", answer)
        assert verdict.status == WRONG and f"your code raised {error}" in verdict.detail, verdict


def test_a_stub_is_not_solved_and_not_a_checker_error(harness_exercises):
    def stub(n):
        raise NotImplementedError("your code here")

    assert grade("99.1", stub).status == NOT_SOLVED and grade("99.1", None).status == NOT_SOLVED


def test_grade_records_each_verdict_as_a_json_line(tmp_path, monkeypatch):
    record = tmp_path / "verdicts.jsonl"
    monkeypatch.setenv(VERDICTS_ENV, str(record))
    grade("03.1", lambda doc_ids: doc_ids.float())
    grade("03.1", None)
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(v["exercise"], v["status"]) for v in lines] == [("03.1", WRONG), ("03.1", NOT_SOLVED)]


def test_a_cell_past_the_time_limit_is_interrupted_and_the_notebook_goes_on(tmp_path, capsys):
    path = notebook(tmp_path, EX_03_2, "while True:\n    pass", EX_03_1, SOLVE_03_1)
    rows = check_notebook(path, timeout=3)
    assert rows == [("03.2", NOT_CHECKED, "cell 2 ran past the 3 s limit and was interrupted"),
                    ("03.1", "correct", "")]  # the cells after the interrupted one ran
    assert main(["check", str(path), "--timeout", "3"]) == 1
    out = capsys.readouterr().out
    assert "1 of 2 correct; 1 not checked" in out and "Traceback" not in out


@pytest.mark.parametrize("death", ["import os\nos._exit(1)", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"])
def test_a_kernel_that_dies_leaves_its_exercise_and_the_later_ones_not_checked(tmp_path, capsys, death):
    path = notebook(tmp_path, SOLVE_03_1, EX_03_1, "x = 1", EX_03_2, death, "#md ```{exercise-start}\n:label: ex-03-3\n```",
                    SOLVE_03_1)
    died = "cell 5 stopped the kernel (it died: out of memory, or an exit?); later cells did not run"
    assert check_notebook(path) == [("03.1", "correct", ""), ("03.2", NOT_CHECKED, died), ("03.3", NOT_CHECKED, died)]
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "1 of 3 correct; 2 not checked" in out and "Traceback" not in out
