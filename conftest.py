"""pytest configuration for ``pytest --nbval notebooks solutions`` (``make notebooks``).

nbval compares every output of a re-executed notebook with the stored one. The values a cell
glues for the book's prose (myst-nb ``glue``: the ``application/papermill.record/*`` outputs)
are stored at full precision, and a float computed with another number of threads differs in
its last bits (another summation order). The cells print the same numbers with the digits the
prose shows, and nbval compares those; the glued records themselves are left out.
"""
from __future__ import annotations

GLUE_MIMES = tuple(f"application/papermill.record/{mime}"
                   for mime in ("text/plain", "text/markdown", "text/html", "image/png", "image/svg+xml"))


def pytest_configure(config):
    try:
        from nbval.plugin import IPyNbFile
    except ImportError:  # nbval is not installed: nothing to configure
        return
    if getattr(IPyNbFile, "_skips_glue", False):
        return
    original = IPyNbFile.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.skip_compare = tuple(self.skip_compare) + GLUE_MIMES

    IPyNbFile.__init__ = __init__
    IPyNbFile._skips_glue = True
