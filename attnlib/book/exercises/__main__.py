"""Check a learner's notebook: ``python -m attnlib.book.exercises check NOTEBOOK.ipynb``.

Executes the notebook in a fresh kernel (errors do not stop it) and prints a table of every
exercise the notebook declares (``{exercise-start}`` blocks with ``:label: ex-NN-k``): correct /
not solved yet / wrong (with the check's hint) / checker error / not checked (no check ran,
e.g. because an earlier cell failed).

The verdicts come from the checks themselves: the kernel runs with
``ATTNLIB_EXERCISE_VERDICTS`` naming a fresh file, where every :func:`grade` call records its
verdict as a JSON line; the table is read from that file. Text the notebook prints counts for
nothing (a cell printing ``Exercise 03.1: correct`` checks nothing).

Exit status: 0 when every exercise is correct, 1 otherwise, 2 for a bad command line (an
argparse ``error:`` line): a missing file, or one that is not a Jupyter notebook.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from attnlib import _cli
from attnlib.book.exercises._core import CORRECT, VERDICTS_ENV

__all__ = ["NOT_CHECKED", "check_notebook", "main", "read_notebook"]

NOT_CHECKED = "not checked"
_LABEL = re.compile(r":label:\s*ex-(\d+)-(\d+)")


def read_notebook(path: str | Path):
    """Read and validate a Jupyter notebook (nbformat 4).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a valid Jupyter notebook (not JSON, or not nbformat).
    """
    import nbformat

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no notebook at {path}")
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a Jupyter notebook (not JSON: {e})") from None
    if not isinstance(data, dict) or "cells" not in data or "nbformat" not in data:
        raise ValueError(f"{path} is not a Jupyter notebook (JSON without 'nbformat' and 'cells')")
    try:
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
    except Exception as e:  # nbformat's ValidationError and friends: a notebook it cannot read
        raise ValueError(f"{path} is not a valid Jupyter notebook ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    return nb


def check_notebook(path: str | Path, timeout: int = 600) -> list[tuple[str, str, str]]:
    """Execute ``path`` and return ``[(exercise id, status, detail), ...]`` in the notebook's order.

    Declared exercises come first, in order, then any other exercise a check graded.

    Raises:
        FileNotFoundError: no such notebook.
        ValueError: not a Jupyter notebook (see :func:`read_notebook`).
    """
    from nbclient import NotebookClient

    path = Path(path)
    nb = read_notebook(path)
    declared = [f"{int(a):02d}.{int(b)}" for cell in nb.cells if cell.cell_type == "markdown"
                for a, b in _LABEL.findall(cell.source)]
    with tempfile.TemporaryDirectory(prefix="attnlib-check-") as tmp:
        record = Path(tmp) / "verdicts.jsonl"
        record.touch()
        before = os.environ.get(VERDICTS_ENV)
        os.environ[VERDICTS_ENV] = str(record)  # the kernel inherits the environment
        try:
            client = NotebookClient(nb, timeout=timeout, allow_errors=True,
                                    resources={"metadata": {"path": str(path.resolve().parent)}})
            client.execute()
        finally:
            if before is None:
                del os.environ[VERDICTS_ENV]
            else:
                os.environ[VERDICTS_ENV] = before
        verdicts: dict[str, tuple[str, str]] = {}
        for line in record.read_text(encoding="utf-8").splitlines():
            v = json.loads(line)
            verdicts[v["exercise"]] = (v["status"], v["detail"])  # the last check of an exercise counts
    ids = declared + [i for i in verdicts if i not in declared]
    return [(i, *verdicts.get(i, (NOT_CHECKED, "no check ran for it (did an earlier cell fail?)"))) for i in ids]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m attnlib.book.exercises", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="execute a notebook and report every exercise")
    check.add_argument("notebook")
    check.add_argument("--timeout", type=_cli.positive_int, default=600, help="seconds per cell (default: 600)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command line: ``check NOTEBOOK.ipynb [--timeout S]``; prints the table, returns the exit status.

    A bad command line (unknown flag, missing file, not a notebook) exits with status 2 and an
    argparse ``error:`` line, raising :class:`SystemExit`.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        read_notebook(args.notebook)  # refuse a bad file before starting a kernel
    except (FileNotFoundError, ValueError) as e:
        parser.error(f"argument notebook: {e}")
    rows = check_notebook(args.notebook, args.timeout)
    width = max([len("exercise")] + [len(i) for i, _, _ in rows])
    print(f"{'exercise':{width}s}  {'status':15s}  detail")
    for exercise_id, status, detail in rows:
        print(f"{exercise_id:{width}s}  {status:15s}  {detail}")
    n_correct = sum(status == CORRECT for _, status, _ in rows)
    print(f"{n_correct} of {len(rows)} correct")
    return 0 if rows and n_correct == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
