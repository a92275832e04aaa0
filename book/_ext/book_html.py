"""Sphinx extension for the book's HTML.

- Each script tag once (below).
- ``static/book.css``: outputs wrap instead of scrolling sideways, 88-column code fits the column
  at 1280 px, long inline code breaks so no page is wider than a phone (issue 12, items 3 and 5).
- ``static/book.js``: the menu and page-contents buttons a reader sees work (issue 12, item 7).
- One exercise number: an exercise labelled ``ex-NN-k`` is "Exercise NN.k" in its box title, in
  the title of its solution ("Solution to Exercise NN.k") and in every ``{ref}`` to it (issue 12,
  item 2). See :func:`_number_exercises`.
- ``static/widgets-setup.js``: the ipywidgets embed manager's set-up (listed in _config.yml).

Sphinx 7.4 records an inline script added while documents are read (sphinx-togglebutton's and
sphinx-thebe's) twice, once with filename ``None`` and once with ``''``, and writes both into
every page; a repeated ``const`` declaration is then a JavaScript error in the reader's
browser (the browser tests catch it). Keep the first of each script.
"""
from __future__ import annotations

import re
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


#: An exercise label that carries its number: chapter ``NN``, exercise ``k`` of the chapter.
EXERCISE_LABEL = re.compile(r"^ex-(\d\d)-(\d+)$")


def _number_exercises(app, env) -> list[str]:
    """Number each exercise labelled ``ex-NN-k`` as ``NN.k`` instead of by its place in the book.

    sphinx-exercise registers its exercises as Sphinx "enumerable" nodes of type ``exercise``;
    Sphinx numbers them on ``env-get-updated`` (the toctree collector's handler fills
    ``env.toc_fignumbers[docname]["exercise"][id]``, counting through the whole book: "Exercise
    41"), and everything that shows the number reads it from there: the box title
    (``numfig_format["exercise"] % number``), the solution's title (sphinx-exercise's
    ``get_node_number``) and ``{ref}``/``{numref}`` to the exercise. Replacing the number there,
    right after that handler (same event, a later priority), changes all three at once. The
    number is a tuple of strings, joined with ``.``: ``("03", "1")`` -> "Exercise 03.1". An
    exercise whose label does not have the form ``ex-NN-k`` keeps Sphinx's number.

    Returns the pages holding an exercise or a solution: Sphinx writes them again (an incremental
    build compares its own numbering with the last build's, and would otherwise keep stale titles).
    """
    for numbers in env.toc_fignumbers.values():
        exercises = numbers.get("exercise", {})
        for node_id in exercises:
            match = EXERCISE_LABEL.match(node_id)
            if match:
                exercises[node_id] = (match[1], str(int(match[2])))
    registry = getattr(env, "sphinx_exercise_registry", {})
    return sorted({entry["docname"] for entry in registry.values()} & env.found_docs)


def setup(app):
    app.connect("builder-inited", _add_static)
    app.connect("html-page-context", _unique_scripts)
    app.connect("env-get-updated", _number_exercises, priority=900)  # after Sphinx's numbering (500)
    app.add_css_file("book.css")
    app.add_js_file("book.js", loading_method="defer")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
