"""`python -m attnlib.book.exercises check`: a chapter is all 'not solved yet', its solutions all 'correct'."""
import subprocess
import sys
from pathlib import Path

import pytest

from attnlib.book.exercises.__main__ import NOT_CHECKED, check_notebook, main

ROOT = Path(__file__).resolve().parents[1]


def test_chapter_is_not_solved_and_solutions_are_correct():
    chapter = check_notebook(ROOT / "notebooks" / "03_causal_attention.ipynb")
    solutions = check_notebook(ROOT / "solutions" / "03_causal_attention_solutions.ipynb")
    assert [i for i, _, _ in chapter] == ["03.1", "03.2", "03.3", "03.4"] == [i for i, _, _ in solutions]
    assert {status for _, status, _ in chapter} == {"not solved yet"}
    assert {status for _, status, _ in solutions} == {"correct"}


def test_command_line_table_and_exit_status(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "attnlib.book.exercises", "check", str(ROOT / "solutions" / "01_attention_from_averages_solutions.ipynb")],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "01.1" in result.stdout and "3 of 3 correct" in result.stdout


def test_a_broken_notebook_reports_wrong_and_not_checked(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("```{exercise-start}\n:label: ex-03-1\n```"),
        nbformat.v4.new_code_cell("from attnlib.book.exercises import ch03\nch03.check_bottom_right_causal_mask(lambda T_q, T_k: None + 1)"),
        nbformat.v4.new_markdown_cell("```{exercise-start}\n:label: ex-03-2\n```"),
        nbformat.v4.new_code_cell("raise RuntimeError('a learner typo')"),
    ]
    path = tmp_path / "mine.ipynb"
    nbformat.write(nb, path)
    rows = check_notebook(path)
    assert rows[0][:2] == ("03.1", "wrong") and "TypeError" in rows[0][2]
    assert rows[1][:2] == ("03.2", NOT_CHECKED)
    assert main(["check", str(path)]) == 1


def test_missing_notebook():
    assert main(["check", "no/such.ipynb"]) == 2
    with pytest.raises(SystemExit):
        main([])
