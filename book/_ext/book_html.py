"""Sphinx extension for the book's HTML.

- Each script tag once (below).
- ``static/book.css``: outputs wrap instead of scrolling sideways, 88-column code fits the column
  at 1280 px, long inline code breaks so no page is wider than a phone (issue 12, items 3 and 5).
- ``static/book.js``: the menu and page-contents buttons a reader sees work (issue 12, item 7).
- One exercise number: an exercise labelled ``ex-NN-k`` is "Exercise NN.k" in its box title, in
  the title of its solution ("Solution to Exercise NN.k") and in every ``{ref}`` to it (issue 12,
  item 2). See :func:`_number_exercises`.
- ``static/widgets-setup.js``: the ipywidgets embed manager's set-up (listed in _config.yml).
- One figure number: chapter NN's figures are "Fig. NN.1", "Fig. NN.2", ..., continued on its
  solutions page (:func:`_number_figures`), as its exercises are numbered NN.k.
- Launching and downloading give the plain-Jupyter copy of a chapter, ``launch/<page>.ipynb``
  (``make launch``, book/_ext/launch.py), not its MyST source: the Colab and Binder buttons open
  it (:func:`_launch_copies`), and the ``.ipynb`` download is it (:func:`_download_launch_copies`).
- The bibliography lists each work under the label its citations show in the text, "Vaswani et
  al., 2017", sorted by author and year (:class:`AuthorYearLabels`, style ``author_year``).

Sphinx 7.4 records an inline script added while documents are read (sphinx-togglebutton's and
sphinx-thebe's) twice, once with filename ``None`` and once with ``''``, and writes both into
every page; a repeated ``const`` declaration is then a JavaScript error in the reader's
browser (the browser tests catch it). Keep the first of each script.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from pybtex.plugin import register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from sphinx.util import logging

LOGGER = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"  # widgets-setup.js, listed in _config.yml's nb_ipywidgets_js
#: The launch copies' folder (book/_ext/launch.py writes launch/notebooks/..., launch/solutions/...).
LAUNCH = "launch"


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


#: A chapter's or a solution page's docname: ``notebooks/NN_...`` or ``solutions/NN_...``.
CHAPTER_PAGE = re.compile(r"^(notebooks|solutions)/(\d\d)_")


def _number_figures(app, env) -> list[str]:
    """Number the figures of chapter NN as "Fig. NN.1", "Fig. NN.2", ..., in the order of the page,
    and go on counting on the chapter's solutions page, instead of counting through the whole book
    ("Fig. 49"). Same mechanism as :func:`_number_exercises` (``env.toc_fignumbers``, right after
    Sphinx numbered them). Returns the pages whose numbers it set, for Sphinx to write again."""
    counted: dict[str, int] = {}
    changed = []
    for docname in sorted(env.toc_fignumbers, key=lambda d: (d.startswith("solutions/"), d)):
        match = CHAPTER_PAGE.match(docname)
        figures = env.toc_fignumbers[docname].get("figure", {})
        if not match or not figures:
            continue
        chapter = match[2]
        for node_id, _ in sorted(figures.items(), key=lambda item: item[1]):
            counted[chapter] = counted.get(chapter, 0) + 1
            figures[node_id] = (chapter, str(counted[chapter]))
        changed.append(docname)
    return sorted(set(changed) & env.found_docs)


def _launch_copies(app, pagename, templatename, context, doctree) -> None:
    """Point the page's Colab and Binder buttons at ``launch/<page>.ipynb`` instead of the chapter.

    sphinx-book-theme's ``add_launch_buttons`` (``html-page-context``, priority 501) builds each
    URL from the page's path in the repository: Binder's ``...?urlpath=tree/notebooks/NN_x.ipynb``
    and Colab's ``.../blob/<branch>/notebooks/NN_x.ipynb``. Run after it (priority 900), this
    replaces that path by the launch copy's, which ``make launch`` keeps committed beside the
    chapters."""
    source = f"/{pagename}.ipynb"
    for group in context.get("header_buttons", []):
        if group.get("label") != "launch-buttons":
            continue
        if not (Path(app.srcdir) / LAUNCH / f"{pagename}.ipynb").is_file():
            LOGGER.warning(f"no launch copy {LAUNCH}/{pagename}.ipynb: run `make launch`", location=pagename)
            return
        for button in group.get("buttons", []):
            url = button.get("url", "")
            if url.endswith(source):
                button["url"] = url[: -len(source)] + f"/{LAUNCH}{source}"


def _download_launch_copies(app, exception) -> None:
    """The page's ``.ipynb`` download (``_sources/<page>.ipynb``) is the launch copy too."""
    if exception is not None or app.builder.format != "html":
        return
    for copy in sorted((Path(app.srcdir) / LAUNCH).glob("*/*.ipynb")):
        target = Path(app.outdir) / "_sources" / copy.relative_to(Path(app.srcdir) / LAUNCH)
        if target.is_file():
            shutil.copyfile(copy, target)


def author_year(entry) -> str:
    """"Vaswani et al., 2017", "Zhang and Sennrich, 2019", "Shazeer, 2019": how the book's
    author-year citations (``bibtex_reference_style: author_year``) name a work in the text."""
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    names = [Text.from_latex(" ".join(p.prelast_names + p.last_names)).render_as("text") for p in people]
    if len(names) > 2:
        names = [f"{names[0]} et al."]
    return f"{' and '.join(names)}, {entry.fields.get('year', 'n.d.')}"


class AuthorYearLabels(BaseLabelStyle):
    """Bibliography labels as the text cites: "[Vaswani et al., 2017]" instead of "[VSP+17]".

    Two works that would get the same label carry a letter in their ``year`` field
    (``2023a``, ``2023b``: book/references.bib), so that the text tells them apart too;
    sphinxcontrib-bibtex warns about a duplicate label (an error in the strict build)."""

    def format_labels(self, sorted_entries):
        for entry in sorted_entries:
            yield author_year(entry)


class AuthorYearStyle(UnsrtStyle):
    """pybtex's ``unsrt`` entries, labelled by :class:`AuthorYearLabels`, sorted by author and year."""

    default_label_style = "book_author_year"
    default_sorting_style = "author_year_title"


def setup(app):
    register_plugin("pybtex.style.labels", "book_author_year", AuthorYearLabels)
    register_plugin("pybtex.style.formatting", "author_year", AuthorYearStyle)
    app.connect("builder-inited", _add_static)
    app.connect("html-page-context", _unique_scripts)
    app.connect("html-page-context", _launch_copies, priority=900)  # after sphinx-book-theme's (501)
    app.connect("build-finished", _download_launch_copies)
    app.connect("env-get-updated", _number_exercises, priority=900)  # after Sphinx's numbering (500)
    app.connect("env-get-updated", _number_figures, priority=900)
    app.add_css_file("book.css")
    app.add_js_file("book.js", loading_method="defer")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
