"""Sphinx extension for the book's HTML: each script tag once, and the widgets' set-up script.

Sphinx 7.4 records an inline script added while documents are read (sphinx-togglebutton's and
sphinx-thebe's) twice, once with filename ``None`` and once with ``''``, and writes both into
every page; a repeated ``const`` declaration is then a JavaScript error in the reader's
browser (the browser tests catch it). Keep the first of each script.
"""
from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).parent / "static"  # widgets-setup.js, listed in _config.yml's nb_ipywidgets_js


def _unique_scripts(app, pagename, templatename, context, doctree) -> None:
    seen, unique = set(), []
    for script in context.get("script_files", []):
        key = (script.filename or "", script.priority, tuple(sorted(script.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def _add_static(app) -> None:
    app.config.html_static_path.append(str(STATIC))


def setup(app):
    app.connect("builder-inited", _add_static)
    app.connect("html-page-context", _unique_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
