"""No exercise can be answered by copying a cell of its chapter.

Each solution's answers (the functions and classes its cells hand to a ``check_*``) are compared with
the chapter's code, names and whitespace normalised: every identifier that is not an attribute reads
``N``, every string ``S``, a ``return E`` reads ``E`` and an assignment ``x = E`` reads ``E``. An
answer whose whole body equals a run of consecutive statements of the chapter (a cell, or the body
of a function, loop or class in it) is a copy, and the test fails on it.
"""
from __future__ import annotations

import ast
import io
import json
import keyword
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
SOLUTIONS = sorted((REPO / "solutions").glob("[0-9][0-9]_*_solutions.ipynb"))
#: bodies shorter than this many tokens (``N = N.N(N)``) are too small to be a copy of anything
MIN_TOKENS = 12


def _code_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    sources = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
        sources.append("\n".join(lines))
    return sources


def _parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _normalised(statement: ast.stmt) -> tuple[str, ...]:
    """The statement's tokens with names as ``N`` and strings as ``S`` (``return E`` and ``x = E`` read ``E``)."""
    if isinstance(statement, ast.Return) and statement.value is not None:
        node: ast.AST = statement.value
    elif isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
        node = statement.value
    else:
        node = statement
    text = ast.unparse(node)
    tokens, previous = [], ""
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.NAME and not keyword.iskeyword(token.string) and previous != ".":
            tokens.append("N")
        elif token.type == tokenize.STRING:
            tokens.append("S")
        elif token.type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
                            tokenize.COMMENT):
            continue
        else:
            tokens.append(token.string)
        previous = token.string
    return tuple(tokens)


def _body(statements: list[ast.stmt]) -> list[tuple[str, ...]]:
    """The normalised statements of a body, its docstring left out."""
    if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant) \
            and isinstance(statements[0].value.value, str):
        statements = statements[1:]
    return [_normalised(s) for s in statements]


def _chapter_bodies(tree: ast.Module) -> list[list[tuple[str, ...]]]:
    """The cell's statements and the body of every function, class, loop and branch in it."""
    bodies = [_body(tree.body)]
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            statements = getattr(node, name, None)
            if node is not tree and isinstance(statements, list) and statements and isinstance(statements[0], ast.stmt):
                bodies.append(_body(statements))
    return bodies


def _answers(sources: list[str]) -> dict[str, list[list[tuple[str, ...]]]]:
    """The answers a solution hands to a ``check_*``: name -> the normalised bodies of its function or methods."""
    trees = [t for t in (_parse(s) for s in sources) if t is not None]
    checked = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name.startswith("check_"):
                    checked |= {a.id for a in node.args if isinstance(a, ast.Name)}
    answers: dict[str, list[list[tuple[str, ...]]]] = {}
    for tree in trees:
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in checked:
                answers[node.name] = [_body(node.body)]
            elif isinstance(node, ast.ClassDef) and node.name in checked:
                answers[node.name] = [_body(m.body) for m in node.body if isinstance(m, ast.FunctionDef)]
    return answers


def _contains(haystack: list[tuple[str, ...]], needle: list[tuple[str, ...]]) -> bool:
    m = len(needle)
    return any(haystack[i:i + m] == needle for i in range(len(haystack) - m + 1))


def copies(solution: Path) -> list[str]:
    """The answers of ``solution`` that repeat a run of statements of their chapter."""
    chapter = REPO / "notebooks" / solution.name.replace("_solutions", "")
    bodies = [b for t in (_parse(s) for s in _code_cells(chapter)) if t is not None for b in _chapter_bodies(t)]
    found = []
    for name, methods in _answers(_code_cells(solution)).items():
        for body in methods:
            if sum(len(s) for s in body) >= MIN_TOKENS and any(_contains(b, body) for b in bodies):
                found.append(name)
                break
    return found


def test_the_normalisation_sees_through_renaming():
    a = _parse("def f(x, y):\n    s = x @ y.transpose(-2, -1)  # scores\n    return s.softmax(-1)\n").body[0]
    b = _parse("scores = q @ k.transpose(-2, -1)\nweights = scores.softmax(-1)\n")
    assert _contains(_chapter_bodies(b)[0], _body(a.body))
    c = _parse("scores = q @ k.transpose(-1, -2)\nweights = scores.softmax(-1)\n")
    assert not _contains(_chapter_bodies(c)[0], _body(a.body))


def test_every_solution_checks_its_answers():
    assert len(SOLUTIONS) >= 19
    for solution in SOLUTIONS:
        assert _answers(_code_cells(solution)), f"{solution.name}: no answer handed to a check_* found"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name[:2])
def test_no_answer_is_a_copy_of_its_chapter(solution):
    found = copies(solution)
    assert not found, (f"{solution.name}: {found} repeat the chapter's own code; an exercise must need the "
                       "chapter's idea applied somewhere new")
