"""The results files the chapters read, shipped inside the package (so a wheel has them too).

* ``compare_attention.json``: chapter 13's run of ``python -m attnlib.book.experiments.compare_attention``
  (every variant, several seeds);
* ``bench_<name>.json``: full-size runs of ``python -m attnlib.bench <name> --out FILE`` (chapters 15-19;
  ``bench_modern.json`` is ``train --modern``, chapter 16);
* ``long_context.json``, ``beyond_softmax.json``, ``speculative.json``, ``layer_patterns.json``: the
  experiments of chapters 17, 18, 19 and 20 (``python -m attnlib.book.experiments.<name>``);
* ``recall.json``: chapter 21's multi-query associative recall experiment; ``kv_compression.json`` and
  ``retrieval.json``: chapter 22's.

Each file records the command, the machine and the commit that produced it. They are read
with :mod:`importlib.resources`, never from a path computed from ``__file__``, so they are
found the same way from a checkout, an editable install or a wheel. To replace one, rerun its
command with the output path pointing here (in a checkout:
``--out attnlib/book/results/compare_attention.json``).
"""
from __future__ import annotations

import json
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.abc import Traversable

__all__ = ["NAMES", "load", "path", "read"]

#: The committed results files, by name (the file name without ``.json``): every ``*.json`` shipped here.
NAMES = tuple(sorted(f.name[: -len(".json")] for f in resources.files(__name__).iterdir() if f.name.endswith(".json")))


def path(name: str) -> Traversable:
    """The committed results file ``name`` (one of :data:`NAMES`), as an importlib.resources Traversable.

    Raises:
        ValueError: ``name`` is not one of :data:`NAMES`.
        FileNotFoundError: the file is missing from this installation.
    """
    if name not in NAMES:
        raise ValueError(f"name={name!r} is not a committed results file; expected one of {NAMES}")
    file = resources.files(__name__) / f"{name}.json"
    if not file.is_file():
        raise FileNotFoundError(f"the results file {name}.json is missing from this installation of attnlib ({file})")
    return file


def load(name: str) -> dict:
    """Read the committed results file ``name`` (one of :data:`NAMES`) as a dict."""
    return json.loads(path(name).read_text(encoding="utf-8"))


def read(name: str, file=None) -> dict:
    """An experiment's results: the committed file ``name`` (``file`` None), or the file at ``file`` written by
    ``python -m attnlib.book.experiments.<name> --out FILE``.

    Raises:
        FileNotFoundError: no file at ``file`` (the message gives the command that writes it).
    """
    if file is None:
        return load(name)
    from pathlib import Path

    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"no results at {file}; run `python -m attnlib.book.experiments.{name} --out {file}` "
                                "first")
    return json.loads(file.read_text(encoding="utf-8"))
