"""Check a learner's notebook: ``python -m attnlib.book.exercises check NOTEBOOK.ipynb``.

Executes the notebook in a fresh kernel (errors do not stop it; a cell past ``--timeout`` seconds
is interrupted and the rest runs) and prints a table of every exercise the notebook declares
(``{exercise-start}`` blocks with ``:label: ex-NN-k``): correct / not solved yet / wrong (with the
check's hint) / checker error / not checked (no check ran: an earlier cell failed, a cell ran past
the limit, or the kernel died, named with its cell), then a count of each.

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
from collections import Counter
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

    Declared exercises come first, in order, then any other exercise a check graded. A cell that runs
    past ``timeout`` seconds is interrupted and the notebook goes on; a kernel that dies (out of memory,
    ``os._exit``) ends the run. Either way the exercises left without a verdict are "not checked", and the
    detail names the cell (counted from 1, as Jupyter shows them) and what stopped it.

    Raises:
        FileNotFoundError: no such notebook.
        ValueError: not a Jupyter notebook (see :func:`read_notebook`).
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    path = Path(path)
    nb = read_notebook(path)
    declared, starts = [], []  # each declared exercise and the index of the cell that declares it
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for a, b in _LABEL.findall(cell.source):
                declared.append(f"{int(a):02d}.{int(b)}")
                starts.append(index)
    stopped: dict[int, str] = {}  # cell index -> what stopped it
    died: list[int] = []  # the cell in which the kernel died: no later cell ran
    running = {"cell": None}

    def on_cell_start(cell, cell_index):
        running["cell"] = cell_index

    def on_cell_executed(cell, cell_index, execute_reply):
        if execute_reply["content"].get("ename") == _TIMED_OUT:
            stopped[cell_index] = f"ran past the {timeout} s limit and was interrupted"

    with tempfile.TemporaryDirectory(prefix="attnlib-check-") as tmp:
        record = Path(tmp) / "verdicts.jsonl"
        record.touch()
        before = os.environ.get(VERDICTS_ENV)
        os.environ[VERDICTS_ENV] = str(record)  # the kernel inherits the environment
        try:
            client = NotebookClient(nb, timeout=timeout, allow_errors=True, interrupt_on_timeout=True,
                                    error_on_timeout={"ename": _TIMED_OUT, "evalue": f"{timeout} s", "traceback": []},
                                    on_cell_start=on_cell_start, on_cell_executed=on_cell_executed,
                                    resources={"metadata": {"path": str(path.resolve().parent)}})
            client.execute()
        except DeadKernelError:
            stopped[running["cell"]] = "stopped the kernel (it died: out of memory, or an exit?); later cells did not run"
            died.append(running["cell"])
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
    return [(i, *verdicts.get(i, (NOT_CHECKED, _why_not_checked(i, declared, starts, stopped, died, len(nb.cells)))))
            for i in ids]


_TIMED_OUT = "CellTimeout"


def _why_not_checked(exercise_id: str, declared: list[str], starts: list[int], stopped: dict[int, str], died: list[int],
                     n_cells: int) -> str:
    """The detail of an exercise no check graded: what stopped a cell of its part of the notebook (from its
    label to the next exercise's), or a kernel that died before it; else an earlier cell's failure."""
    if exercise_id in declared:
        k = declared.index(exercise_id)
        first, end = starts[k], starts[k + 1] if k + 1 < len(starts) else n_cells
        for index in sorted(stopped):
            if first <= index < end or (index < first and index in died):
                return f"cell {index + 1} {stopped[index]}"
    return "no check ran for it (did an earlier cell fail?)"


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
    counts = Counter(status for _, status, _ in rows if status != CORRECT)
    print(f"{n_correct} of {len(rows)} correct" + "".join(f"; {n} {status}" for status, n in counts.items()))
    return 0 if rows and n_correct == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
