"""Numbers the chapters' prose quotes, glued from the cell that computes them.

``glue(name, value)`` records ``value`` for the book's ``{glue:text}`name:.2f``` role
(myst-nb), so a sentence and the output it quotes cannot disagree. Run on Colab or Binder,
where myst-nb is not installed, it does nothing (the prose is only rendered by the book).
"""
from __future__ import annotations

from typing import Any


def glue(name: str, value: Any) -> None:
    """Glue ``value`` under ``name`` for the rendered book, showing nothing in the notebook.

    Raises:
        ValueError: ``name`` is not a non-empty identifier-like string (letters, digits, ``_``, ``-``).
    """
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"name must be a non-empty string of letters, digits, '_' or '-', got {name!r}")
    try:
        from myst_nb import glue as myst_glue
    except ImportError:
        return
    myst_glue(name, value, display=False)
