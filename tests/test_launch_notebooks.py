"""The launch notebooks (launch/, ``make launch``): plain Jupyter, current, the chapters' own code.

book/_ext/launch.py converts every chapter and solution into the copy that the book's Colab and
Binder buttons open and its download gives. These tests regenerate every copy into a temporary
folder and compare it with the committed one (after any change to a notebook: ``make launch``);
parse each copy's Markdown with the book's own MyST parser and find no role, directive, target or
colon fence in it; check that the copy runs exactly the chapter's code cells, in the chapter's
order, with the chapter's outputs, and that its first cell installs the extras its imports need.
tests/test_launch.py runs the first launch notebooks in a fresh environment without attnlib.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import launch  # noqa: E402  (book/_ext/launch.py, the converter)

SOURCES = launch.source_notebooks()
IDS = [f"{p.parent.name}/{p.stem}" for p in SOURCES]
COPIES = [ROOT / launch.LAUNCH / p.relative_to(ROOT) for p in SOURCES]
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))

#: Any MyST role, ``{name}`text```, and any directive fence, ```` ```{name} ```` or ``:::{name}``,
#: whatever the name: a general check, not a list of today's roles.
ROLE = re.compile(r"\{[A-Za-z][\w:+.-]*\}`")
DIRECTIVE_FENCE = re.compile(r"^\s*(?:`{3,}|~{3,}|:{3,})\s*\{", re.MULTILINE)
COLON_FENCE = re.compile(r"^\s*:{3,}", re.MULTILINE)
#: The markup the issue saw in Colab, spelled out.
LITERALS = ("{glue", "{exercise", "{solution", "{ref", "{numref", "{doc", "{cite", "```{", ":::")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("launch")
    launch.write_all(out)
    return out


def test_the_committed_launch_notebooks_are_current(regenerated):
    committed = {p.relative_to(ROOT / launch.LAUNCH) for p in (ROOT / launch.LAUNCH).glob("*/*.ipynb")}
    expected = {p.relative_to(regenerated) for p in regenerated.glob("*/*.ipynb")}
    assert expected == {p.relative_to(ROOT) for p in SOURCES}
    assert committed == expected, f"launch/ has {sorted(committed - expected)} extra, lacks {sorted(expected - committed)}: run `make launch`"
    stale = [str(path) for path in sorted(expected)
             if (regenerated / path).read_bytes() != (ROOT / launch.LAUNCH / path).read_bytes()]
    assert not stale, f"stale launch notebooks (run `make launch` and commit launch/): {stale}"


def test_make_launch_removes_the_copy_of_a_notebook_that_is_gone(tmp_path):
    orphan = tmp_path / "notebooks" / "99_gone.ipynb"
    orphan.parent.mkdir()
    orphan.write_text("{}")
    written = launch.write_all(tmp_path)
    assert not orphan.exists() and len(written) == len(SOURCES)
    assert launch.stale(tmp_path) == []


def _without_code(markdown: str) -> str:
    """The Markdown with its code blocks and inline code spans blanked (MyST's parser finds code)."""
    from markdown_it.token import Token

    tokens = _parse(markdown)
    lines = markdown.split("\n")
    for token in tokens:
        if token.type in ("fence", "code_block") and token.map and not token.info.strip().startswith("{"):
            for i in range(*token.map):
                lines[i] = ""
    text = "\n".join(lines)

    def inline_code(children: list[Token]) -> list[str]:
        return [child.content for child in children or [] if child.type == "code_inline"]

    for token in tokens:
        for code in inline_code(token.children):
            text = text.replace(f"`{code}`", "``")
    return text


def _parse(markdown: str):
    """Tokens of ``markdown`` as the book parses it: myst-parser with _config.yml's extensions."""
    import yaml
    from myst_parser.config.main import MdParserConfig
    from myst_parser.mdit_to_docutils.base import DocutilsRenderer
    from myst_parser.parsers.mdit import create_md_parser

    extensions = yaml.safe_load((ROOT / "_config.yml").read_text())["parse"]["myst_enable_extensions"]
    parser = create_md_parser(MdParserConfig(enable_extensions=set(extensions)), DocutilsRenderer)
    return parser.parse(markdown)


def myst_markup(markdown: str) -> list[str]:
    """What MyST markup ``markdown`` holds: roles, directives, targets, colon fences, comments
    (as MyST's own parser finds them), and the general patterns outside code."""
    found = []
    for token in _parse(markdown):
        if token.type in ("colon_fence", "myst_target", "myst_line_comment", "myst_block_break"):
            found.append(f"{token.type}: {token.markup}{token.info} {token.content[:40]!r}")
        if token.type == "fence" and token.info.strip().startswith("{"):
            found.append(f"directive ```{token.info}")
        for child in token.children or []:
            if child.type == "myst_role":
                found.append(f"role {{{child.meta.get('name')}}}`{child.content}`")
    prose = _without_code(markdown)
    found += [f"role-like text {m[0]!r}" for m in ROLE.finditer(prose)]
    found += [f"directive fence {m[0]!r}" for m in DIRECTIVE_FENCE.finditer(prose)]
    found += [f"colon fence {m[0]!r}" for m in COLON_FENCE.finditer(prose)]
    found += [f"{literal!r}" for literal in LITERALS if literal in prose]
    return found


def test_the_check_finds_myst_markup():
    """The check itself: it finds what the chapters use, and what they might use tomorrow."""
    for markup in ("{glue:text}`ch01_x:.2f`", "{ref}`Solution 01.1 <sol-01-1>`", "{cite:t}`vaswani2017attention`",
                   "{term}`softmax`", "{anything}`new`", "```{exercise-start}\n:label: ex-01-1\n```",
                   ":::{admonition} Trap\nbody\n:::", "```{figure} x.png\n```", "(label)=\n# Title", "% a comment"):
        assert myst_markup(f"Some text.\n\n{markup}\n\nMore text."), markup
    for plain in ("`{glue:text}`", "```python\n```{note}\n```", "`h.{i}` becomes `blocks.{i}`", "$\\sqrt{L}$",
                  "[Vaswani et al. [2017]](https://x.org/b.html#cite-v)"):
        assert not myst_markup(plain), (plain, myst_markup(plain))


@pytest.mark.parametrize("copy", COPIES, ids=IDS)
def test_no_myst_markup_in_a_launch_notebook(copy, regenerated):
    nb = nbformat.read(regenerated / copy.relative_to(ROOT / launch.LAUNCH), as_version=4)
    problems = [f"cell {i}: {found}" for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown"
                for found in myst_markup(cell.source)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_a_launch_notebook_runs_the_chapters_code(source, regenerated):
    """Same code cells, same order, same outputs (less the glue records); only the first cell, the
    install cell, differs: visible, and installing the extras this notebook needs."""
    chapter = nbformat.read(source, as_version=4)
    copy = nbformat.read(regenerated / source.relative_to(ROOT), as_version=4)
    mine = [c for c in chapter.cells if c.cell_type == "code"]
    theirs = [c for c in copy.cells if c.cell_type == "code"]
    assert [c.id for c in mine] == [c.id for c in theirs]
    assert theirs[0].id == launch.INSTALL_CELL_ID and "remove-cell" not in theirs[0].metadata.get("tags", [])
    for ours, launched in zip(mine[1:], theirs[1:], strict=True):
        assert launched.source == ours.source, ours.id
        kept = [o for o in ours.outputs if "scrapbook" not in o.get("metadata", {})]
        assert launched.outputs == kept, ours.id
        assert launched.get("execution_count") == ours.get("execution_count")
        assert launched.metadata.get("tags", []) == ours.metadata.get("tags", []), ours.id


def test_the_install_cell_names_the_extras_the_imports_need(regenerated):
    def install_line(path: Path) -> str:
        cell = nbformat.read(regenerated / path.relative_to(ROOT), as_version=4).cells[0]
        (line,) = [line for line in cell.source.split("\n") if "attnlib[" in line]
        return re.search(r"attnlib\[([\w,]+)\]", line)[1]

    by_name = {p.stem: install_line(p) for p in SOURCES}
    assert by_name["01_attention_from_averages"] == "book"
    assert by_name["11_tokenizers"] == "book,reference"  # tokenizers
    assert by_name["11_tokenizers_solutions"] == "book,reference"  # regex
    for chapter in ("14_exercises_gpt2", "16_modern_decoder", "17_long_context", "18_beyond_softmax", "19_serving"):
        assert by_name[chapter] == "book,reference", chapter  # transformers
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for names in by_name.values():
        assert set(names.split(",")) <= set(extras)


def test_the_install_cell_fits_88_columns_and_does_nothing_where_attnlib_is_importable(monkeypatch):
    cell = launch.install_cell(["book", "reference"])
    assert max(len(line) for line in cell.source.split("\n")) <= 88
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: calls.append(args))
    exec(cell.source, {})  # attnlib is importable here (this checkout)
    assert calls == []


def test_the_install_cell_installs_from_the_repository_or_where_told(monkeypatch):
    import importlib.util

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kwargs: calls.append(cmd))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.delenv("ATTNLIB_INSTALL_FROM", raising=False)
    exec(launch.install_cell(["book", "reference"]).source, {})
    assert calls[-1][-1] == f"attnlib[book,reference] @ git+{launch.REPOSITORY}"
    monkeypatch.setenv("ATTNLIB_INSTALL_FROM", "file:///wheels/attnlib-1.0.0-py3-none-any.whl")
    exec(launch.install_cell(["book"]).source, {})
    assert calls[-1][-1] == "attnlib[book] @ file:///wheels/attnlib-1.0.0-py3-none-any.whl"


def test_the_readme_links_open_the_launch_copies():
    """The README's chapter links, and its Colab and Binder links, open launch/ copies that exist."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    local = re.findall(r"\]\(((?:launch/|notebooks/|solutions/)[^)#]*\.ipynb)\)", readme)
    colab = re.findall(r"colab\.research\.google\.com/github/[^/]+/[^/]+/blob/[^/]+/([^)\s]+\.ipynb)", readme)
    binder = re.findall(r"mybinder\.org/v2/gh/[^?]+\?urlpath=tree/([^)\s]+\.ipynb)", readme)
    assert len(colab) == len(binder) == len(CHAPTERS) and len(local) >= len(CHAPTERS)
    for path in local + colab + binder:
        assert path.startswith("launch/") and (ROOT / path).is_file(), path


# ------------------------------------------------------------------ the conversion, construct by construct


@pytest.fixture
def notebook() -> launch.Notebook:
    glued = {"ch99_loss": {"text/plain": "1.23456"}, "ch99_name": {"text/plain": "'yarn'"},
             "ch99_count": {"text/plain": "124439808"}, "ch99_best": {"text/plain": "'x'", "text/markdown": "YaRN"}}
    return launch.Notebook("notebooks/99_test", glued)


def convert(text: str, nb: launch.Notebook) -> str:
    return launch.convert_markdown(text, nb)


def test_glued_numbers_become_their_values(notebook):
    text = ("Loss {glue:text}`ch99_loss:.2f`, {glue:text}`ch99_count:,d` parameters, "
            "{glue:text}`ch99_name` scaling, **{glue:md}`ch99_best`**, {glue}`ch99_loss`.")
    assert convert(text, notebook) == "Loss 1.23, 124,439,808 parameters, yarn scaling, **YaRN**, 1.23456."
    with pytest.raises(launch.LaunchError, match="no stored glue output named 'ch99_missing'"):
        convert("{glue:text}`ch99_missing:.2f`", notebook)


def test_exercises_become_headings_and_solutions_links(notebook):
    text = ("```{exercise-start}\n:label: ex-03-2\n```\n\n**Do it.** Text.\n\n"
            "{ref}`Solution 03.2 <sol-03-2>`\n\n```{exercise-end}\n```\n\n```{exercise-start} A title\n"
            ":label: ex-03-3\n```\n\nMore.")
    out = convert(text, notebook)
    assert out.startswith("### Exercise 03.2\n\n**Do it.** Text.\n\n[Solution 03.2](")
    assert "solutions/03_causal_attention_solutions.html#sol-03-2)" in out
    assert "\n\n### Exercise 03.3: A title\n\nMore." in out and "\n\n\n" not in out
    solution = convert("```{solution-start} ex-03-2\n:class: dropdown\n:label: sol-03-2\n```\n\nBody.", notebook)
    assert solution.startswith("### Solution to [Exercise 03.2](") and "03_causal_attention.html#ex-03-2)" in solution


def test_admonitions_become_block_quotes_with_their_title(notebook):
    text = (":::{admonition} Trap: a $-\\infty$ mask\n:class: warning\nFirst line.\n\n```python\nx = 1\n```\n"
            ":::\n\n```{note}\nA note with {glue:text}`ch99_loss:.1f`.\n```")
    assert convert(text, notebook) == (
        "> **Trap: a $-\\infty$ mask**\n>\n> First line.\n>\n> ```python\n> x = 1\n> ```\n\n"
        "> **Note**\n>\n> A note with 1.2.")


def test_citations_and_references_become_links_to_the_book(notebook):
    url = launch.book_url()
    assert convert("{cite}`vaswani2017attention`", notebook) == (
        f"[[Vaswani et al., 2017]({url}book/bibliography.html#cite-vaswani2017attention)]")
    assert convert("{cite:t}`shazeer2019fast`", notebook) == (
        f"[Shazeer [2019]]({url}book/bibliography.html#cite-shazeer2019fast)")
    assert convert("{cite:p}`zhang2019rmsnorm,shazeer2019fast`", notebook).count("](") == 2
    assert convert("{ref}`mha-fast-path`", notebook).endswith("notebooks/15_fast_attention.html#mha-fast-path)")
    assert convert("See [the notation](../book/notation.md).", notebook) == f"See [the notation]({url}book/notation.html)."
    assert convert("[Chapter 02](02_self_attention.ipynb)", notebook) == "[Chapter 02](02_self_attention.ipynb)"
    assert convert("{doc}`../book/setup`", notebook) == f"[Setting up]({url}book/setup.html)"
    assert convert("(a-label)=\n## A section", notebook) == "## A section"


def test_code_is_left_alone_and_unknown_markup_stops_the_conversion(notebook):
    code = "`{glue:text}` is a role; `h.{i}` becomes `blocks.{i}`\n\n```python\n{ref}`x`\n```"
    assert convert(code, notebook) == code
    with pytest.raises(launch.LaunchError, match="the role {unknownrole}"):
        convert("{unknownrole}`x`", notebook)
    with pytest.raises(launch.LaunchError, match="the directive {figure}"):
        convert("```{figure} x.png\n```", notebook)


def test_book_html_points_the_launch_buttons_at_the_launch_copies():
    import book_html

    class App:
        srcdir = str(ROOT)

    buttons = [{"url": "https://mybinder.org/v2/gh/o/r/main?urlpath=tree/notebooks/01_attention_from_averages.ipynb"},
               {"url": "https://colab.research.google.com/github/o/r/blob/main/notebooks/01_attention_from_averages.ipynb"}]
    context = {"header_buttons": [{"label": "launch-buttons", "buttons": buttons}]}
    book_html._launch_copies(App(), "notebooks/01_attention_from_averages", "page.html", context, None)
    assert [b["url"] for b in buttons] == [
        "https://mybinder.org/v2/gh/o/r/main?urlpath=tree/launch/notebooks/01_attention_from_averages.ipynb",
        "https://colab.research.google.com/github/o/r/blob/main/launch/notebooks/01_attention_from_averages.ipynb"]


def test_an_optional_dependency_imported_inside_a_function_is_not_an_extra():
    """A library module that imports a package only inside the function needing it (the benchmark against
    transformers) does not make every notebook importing that module install it; a notebook's own import does."""
    module_level = launch._imports("import torch\ndef f():\n    import transformers\n", late=False)
    assert "torch" in module_level and "transformers" not in module_level
    assert "transformers" in launch._imports("def f():\n    import transformers\n")
    chapter_15 = nbformat.read(ROOT / "notebooks" / "15_fast_attention.ipynb", as_version=4)
    assert "attnlib.bench" in set().union(*(launch._imports(c.source) for c in chapter_15.cells if c.cell_type == "code")) \
        or any("from attnlib import bench" in c.source for c in chapter_15.cells)
    assert launch.needed_extras(chapter_15) == ["book"]
