"""The book's figure style (attnlib.book.style) and glue helper (attnlib.book.display)."""
from __future__ import annotations

import matplotlib
import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import pytest

from attnlib.book import display, style


def _relative_luminance(hex_colour: str) -> float:
    r, g, b = (c / 1.0 for c in mcolors.to_rgb(hex_colour))
    lin = [x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4 for x in (r, g, b)]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def test_use_sets_a_column_width_figure_with_readable_fonts():
    with matplotlib.rc_context():
        style.use()
        fig, ax = plt.subplots()
        width_px = fig.get_figwidth() * fig.dpi
        # 560 px at natural size fits a ~700 px column; the smallest font scaled to a 350 px phone column.
        assert width_px <= 700
        smallest_pt = min(matplotlib.rcParams[k] for k in ("xtick.labelsize", "ytick.labelsize", "legend.fontsize"))
        px_on_phone = smallest_pt * fig.dpi / 72 * min(1.0, 350 / width_px)
        assert px_on_phone >= 9, px_on_phone
        plt.close(fig)


def test_each_line_differs_in_colour_and_dash():
    with matplotlib.rc_context():
        style.use()
        fig, ax = plt.subplots()
        lines = [ax.plot([0, 1], [i, i])[0] for i in range(6)]
        colours = {mcolors.to_hex(line.get_color()) for line in lines}
        dashes = {str(line.get_linestyle()) + str(line._dash_pattern) for line in lines}
        assert len(colours) == 6 and len(dashes) == 6
        plt.close(fig)


def test_palette_is_okabe_ito():
    # Okabe & Ito (2008): the published hex values (independent of the module's tuple order).
    published = {"#e69f00", "#56b4e9", "#009e73", "#f0e442", "#0072b2", "#d55e00", "#cc79a7", "#000000"}
    assert {c.lower() for c in style.OKABE_ITO} == published
    # The first colours used for lines are not the pale yellow (hard to see on white).
    assert all(_relative_luminance(c) < 0.6 for c in style.OKABE_ITO[:5])


@pytest.mark.parametrize("n_cols", [1, 2, 3, 5])
def test_size_never_wider_than_the_column(n_cols):
    width, height = style.size(n_cols)
    assert width == style.WIDTH and height > 0


@pytest.mark.parametrize(
    ("args", "match"),
    [((0,), "n_cols must be a positive int, got 0"), ((2.0,), "n_cols must be a positive int, got 2.0"),
     ((True,), "n_cols must be a positive int, got True"), ((1, -1.0), "height must be a positive number"),
     ((1, "3"), "height must be a positive number of inches, got '3'")],
)
def test_size_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        style.size(*args)


@pytest.mark.parametrize("name", ["", "a b", 3, "x/y"])
def test_glue_bad_names(name):
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        display.glue(name, 1.0)


def test_glue_outside_a_notebook_shows_nothing(capsys):
    display.glue("ch00_value", 1.5)
    assert capsys.readouterr().out == ""
