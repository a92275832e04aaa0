"""Check a learner's notebook: ``python -m attnlib.book.exercises check NOTEBOOK.ipynb``.

Executes the notebook in a fresh kernel (errors do not stop it), reads the verdict
line each check cell prints, and prints a table of every exercise the notebook
declares (``{exercise-start}`` blocks with ``:label: ex-NN-k``): correct / not solved
yet / wrong (with the check's hint) / not checked (its check cell did not print a
verdict, e.g. because an earlier cell failed). Exit status: 0 when every exercise is
correct, 1 otherwise, 2 for a bad path.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from attnlib.book.exercises._core import CORRECT, NOT_SOLVED, WRONG

NOT_CHECKED = "not checked"
_LABEL = re.compile(r":label:\s*ex-(\d+)-(\d+)")
_VERDICT = re.compile(rf"^Exercise (\d+\.\d+): ({CORRECT}|{NOT_SOLVED}|{WRONG})(?:: (.*))?$", re.MULTILINE)


def check_notebook(path: str | Path, timeout: int = 600) -> list[tuple[str, str, str]]:
    """Execute ``path`` and return ``[(exercise id, status, detail), ...]`` in the notebook's order.

    Raises:
        FileNotFoundError: no such notebook.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no notebook at {path}")
    nb = nbformat.read(path, as_version=4)
    declared = [f"{int(a):02d}.{int(b)}" for cell in nb.cells if cell.cell_type == "markdown"
                for a, b in _LABEL.findall(cell.source)]
    NotebookClient(nb, timeout=timeout, allow_errors=True, resources={"metadata": {"path": str(path.parent)}}).execute()
    verdicts: dict[str, tuple[str, str]] = {}
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            text = output.get("text", "") if output.get("output_type") == "stream" else ""
            text += output.get("data", {}).get("text/plain", "") if "data" in output else ""
            for exercise_id, status, detail in _VERDICT.findall(text):
                verdicts[exercise_id] = (status, detail)
    ids = declared + [i for i in verdicts if i not in declared]
    return [(i, *verdicts.get(i, (NOT_CHECKED, "its check cell printed no verdict"))) for i in ids]


def main(argv: list[str] | None = None) -> int:
    """Command line: ``check NOTEBOOK.ipynb [--timeout S]``; prints the table, returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m attnlib.book.exercises", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="execute a notebook and report every exercise")
    check.add_argument("notebook")
    check.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    try:
        rows = check_notebook(args.notebook, args.timeout)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    width = max([len("exercise")] + [len(i) for i, _, _ in rows])
    print(f"{'exercise':{width}s}  {'status':15s}  detail")
    for exercise_id, status, detail in rows:
        print(f"{exercise_id:{width}s}  {status:15s}  {detail}")
    n_correct = sum(status == CORRECT for _, status, _ in rows)
    print(f"{n_correct} of {len(rows)} correct")
    return 0 if rows and n_correct == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
