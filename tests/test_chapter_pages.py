"""What every chapter page has: figures with a caption and alt text, and the same ending.

Read from the notebooks themselves (no build): every cell that outputs an image carries myst-nb's
figure options in its metadata (``mystnb.figure.caption`` and ``.name``, ``mystnb.image.alt``),
the alt text says what the image shows (not a file path), and each figure name is used once in
the book. Every chapter ends with the sections Summary, What's next and Sources, then its
Exercises. The browser tests check the rendered pages (browser_tests/).
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NOTEBOOKS = CHAPTERS + sorted((ROOT / "solutions").glob("*.ipynb"))
ENDING = ["Summary", "What's next", "Sources", "Exercises"]


def figure_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in nb.cells if cell.cell_type == "code"
            and any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_figure_has_a_caption_a_name_and_alt_text(path):
    problems = []
    for cell in figure_cells(nbformat.read(path, as_version=4)):
        options = cell.metadata.get("mystnb", {})
        figure, image = options.get("figure", {}), options.get("image", {})
        caption, alt, name = figure.get("caption", ""), image.get("alt", ""), figure.get("name", "")
        if len(caption.split()) < 5:
            problems.append(f"cell {cell.id}: caption {caption!r}")
        if len(alt.split()) < 5 or "/" in alt or re.search(r"\.(png|svg|jpe?g)\b", alt):
            problems.append(f"cell {cell.id}: alt text {alt!r}")
        if not re.fullmatch(r"fig-\d\ds?-[a-z0-9-]+", name):
            problems.append(f"cell {cell.id}: figure name {name!r} is not fig-NN-what")
        displays = [out for out in cell.outputs if out.output_type in ("display_data", "execute_result")
                    and "scrapbook" not in out.get("metadata", {})]
        if len(displays) != 1:  # myst-nb wraps each display of the cell in the figure
            problems.append(f"cell {cell.id}: {len(displays)} displayed outputs besides the figure's")
    assert not problems, "\n".join(problems)


def test_figure_names_are_unique():
    names = [cell.metadata["mystnb"]["figure"]["name"] for path in NOTEBOOKS
             for cell in figure_cells(nbformat.read(path, as_version=4))
             if "name" in cell.metadata.get("mystnb", {}).get("figure", {})]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_ends_the_same_way(path):
    nb = nbformat.read(path, as_version=4)
    sections = [heading for cell in nb.cells if cell.cell_type == "markdown"
                for heading in re.findall(r"^## (.+?)\s*$", cell.source, re.MULTILINE)]
    assert sections[-len(ENDING):] == ENDING, sections[-6:]
