"""The book's one figure style: sizes that fit the content column, legible on a phone.

``style.use()`` (first cell of every chapter) sets matplotlib's parameters and shows
figures as PNG at twice the pixel density (``retina``), so they stay crisp on high-density
screens; nbval does not compare PNG bytes, so stored figures never make a notebook fail.

The numbers, for a content column about 700 px wide on a desktop and 350 px on a phone:

* a full-width figure is :data:`WIDTH` inches wide at 100 dpi (560 CSS px), shown at most at
  its natural size, so on a phone it is scaled by about 350 / 560;
* the smallest text is 10.5 pt (14.6 px at natural size, about 9 px on a phone);
* colours are the Okabe-Ito palette (colour-blind safe) and each line of a plot also has its
  own dash pattern, so lines can be told apart in greyscale or without colour vision.

Use ``figsize=style.size(n_cols)`` (or ``style.size(n_cols, height)``) for a row of panels:
more panels share the same width rather than growing past the column.
"""
from __future__ import annotations

#: Okabe & Ito (2008), "Color Universal Design": distinguishable with every common colour-vision deficiency.
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
#: One dash pattern per line, in the same order as the colours.
DASHES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 1)), (0, (8, 2)), (0, (3, 1, 1, 1)))
#: Width of a full-column figure, in inches (at 100 dpi: 560 CSS px).
WIDTH = 5.6
#: The smallest font size used, in points.
MIN_FONT_PT = 10.5

RC = {
    "figure.figsize": (WIDTH, 3.4),
    "figure.dpi": 100,
    "figure.constrained_layout.use": True,
    "savefig.dpi": 200,
    "font.size": 11.5,
    "axes.titlesize": 12.0,
    "axes.labelsize": 11.5,
    "xtick.labelsize": MIN_FONT_PT,
    "ytick.labelsize": MIN_FONT_PT,
    "legend.fontsize": MIN_FONT_PT,
    "legend.title_fontsize": MIN_FONT_PT,
    "figure.titlesize": 12.5,
    "lines.linewidth": 2.0,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "image.cmap": "viridis",
}


def size(n_cols: int = 1, height: float | None = None) -> tuple[float, float]:
    """A ``figsize`` for ``n_cols`` panels side by side that fits the content column.

    Args:
        n_cols: panels in the row (>= 1). Their total width is :data:`WIDTH`, never more.
        height: figure height in inches; default 3.4 for one panel, less per panel for more
            (square-ish panels).

    Returns:
        ``(width, height)`` in inches.

    Raises:
        ValueError: ``n_cols`` is not a positive int, or ``height`` is not positive.
    """
    if isinstance(n_cols, bool) or not isinstance(n_cols, int) or n_cols < 1:
        raise ValueError(f"n_cols must be a positive int, got {n_cols!r}")
    if height is None:
        height = 3.4 if n_cols == 1 else max(2.2, WIDTH / n_cols + 0.6)
    if not isinstance(height, (int, float)) or isinstance(height, bool) or not height > 0:
        raise ValueError(f"height must be a positive number of inches, got {height!r}")
    return (WIDTH, float(height))


def use() -> None:
    """Apply the book's figure style to matplotlib and show inline figures as 2x PNG.

    Safe to call more than once; outside IPython only the matplotlib parameters change.
    """
    import matplotlib as mpl
    from cycler import cycler

    mpl.rcParams.update(RC)
    mpl.rcParams["axes.prop_cycle"] = cycler(color=list(OKABE_ITO)) + cycler(linestyle=list(DASHES))
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:
        return
    if get_ipython() is not None:
        set_matplotlib_formats("retina")
