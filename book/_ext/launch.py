"""Plain-Jupyter copies of the chapters and solutions: what a learner launches or downloads.

The chapters are MyST notebooks, written for the rendered book: numbers in the prose are glued
(``{glue:text}`name:.2f```), exercises are sphinx-exercise directives, references and
citations are roles, asides are admonitions. Plain Jupyter, JupyterLab and Colab render none of
that. ``make launch`` (``python book/_ext/launch.py``) writes a copy of every notebook of
``notebooks/``, ``solutions/`` and ``book/`` (the library map) into ``launch/`` in which

- a glued number is its value, formatted as the book formats it (from the glue output stored in
  the notebook, which nbval has verified);
- an exercise is a heading "Exercise NN.k" (its stub and check cells follow as before), a
  solution "Solution to Exercise NN.k";
- ``{ref}``, ``{numref}``, ``{doc}`` and ``{term}`` are links into the rendered book (its base URL
  is ``html.baseurl`` in ``_config.yml``); ``{cite}``, ``{cite:p}`` and ``{cite:t}`` are
  author-year text ("Vaswani et al. (2017)") linked to the bibliography page;
- an admonition (``{note}``, ``:::{admonition} Title``, ...) is a block quote whose first line is
  its title in bold, and a dropdown (``{dropdown}`` or ``:class: dropdown``, an answer to a
  follow-up question) an HTML ``<details>`` block, collapsed until clicked; ``{math}`` is ``$...$``;
- a figure's caption (cell metadata ``mystnb.figure.caption``) follows its cell in italics;
- the first cell installs attnlib with the extras whose packages the notebook imports (directly
  or through the attnlib modules it imports), visibly, and does nothing where attnlib is already
  importable.

Every code cell, its source and its stored outputs stay as they are, in the same order (the
outputs that only carry glued values, which plain Jupyter cannot show, are left out). A role or
directive the converter does not know stops it with an error, so nothing reaches a learner raw.
``python book/_ext/launch.py --check`` exits 1 when a committed copy differs from what it would
write (tests/test_launch_notebooks.py runs the same comparison).
"""
from __future__ import annotations

import argparse
import ast
import copy
import re
import sys
from ast import literal_eval
from functools import cache
from pathlib import Path

import nbformat
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("notebooks", "solutions", "book")
#: Where the copies go, mirroring the sources: launch/notebooks/NN_*.ipynb, launch/solutions/...
LAUNCH = "launch"
INSTALL_CELL_ID = "install-attnlib"
REPOSITORY = "https://github.com/attention-from-scratch/attention-from-scratch"

EXERCISE_LABEL = re.compile(r"^ex-(\d\d)-(\d+)$")
SOLUTION_LABEL = re.compile(r"^sol-(\d\d)-(\d+)$")
ROLE = re.compile(r"\{([A-Za-z][\w:+-]*)\}(`+)(.+?)(?<!`)\2(?!`)", re.DOTALL)
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<marker>`{3,}|~{3,}|:{3,})\s*(?P<info>.*?)\s*$")
DIRECTIVE = re.compile(r"^\{(?P<name>[A-Za-z][\w:+-]*)\}\s*(?P<argument>.*)$")
TARGET = re.compile(r"^\s*\(([^()\s]+)\)=\s*$")
ADMONITIONS = {"admonition", "attention", "caution", "danger", "dropdown", "error", "hint", "important",
               "note", "seealso", "tip", "warning"}


class LaunchError(ValueError):
    """Something in a chapter the launch copy cannot express (an unknown role, a missing glue)."""


# ------------------------------------------------------------------------------ the book's index


@cache
def book_url() -> str:
    """The rendered book's base URL, ``html.baseurl`` of _config.yml, ending in ``/``."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    url = (config.get("html") or {}).get("baseurl")
    if not url:
        raise LaunchError("_config.yml has no html.baseurl: the launch copies link to the rendered book there")
    return url.rstrip("/") + "/"


def page_url(docname: str, anchor: str = "") -> str:
    """The rendered book's URL of ``docname`` (``notebooks/03_causal_attention``), at ``#anchor``."""
    return f"{book_url()}{docname}.html" + (f"#{anchor}" if anchor else "")


def source_notebooks() -> list[Path]:
    return [path for folder in SOURCES for path in sorted((ROOT / folder).glob("*.ipynb"))]


def _heading_after(lines: list[str], start: int) -> str:
    for line in lines[start:]:
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if match:
            return match[1].strip()
        if line.strip():
            break
    return ""


@cache
def labels() -> dict[str, tuple[str, str]]:
    """Every label of the book: ``label -> (docname, title)``; the HTML anchor is the label.

    Section targets ``(label)=`` (chapters and the ``book/`` pages), exercises and solutions
    (``:label:``) and named figures (cell metadata ``mystnb.figure.name``)."""
    found: dict[str, tuple[str, str]] = {}
    texts: list[tuple[str, str]] = []
    for path in source_notebooks():
        docname = path.relative_to(ROOT).with_suffix("").as_posix()
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                texts.append((docname, cell.source))
            figure = cell.metadata.get("mystnb", {}).get("figure", {})
            if figure.get("name"):
                found[figure["name"]] = (docname, "this figure")
    for path in sorted((ROOT / "book").glob("*.md")):
        texts.append((path.relative_to(ROOT).with_suffix("").as_posix(), path.read_text(encoding="utf-8")))
    for docname, text in texts:
        lines = text.splitlines()
        for i, line in enumerate(lines):
            target = TARGET.match(line)
            if target:
                found[target[1]] = (docname, _heading_after(lines, i + 1))
            label = re.match(r"^:label:\s*(\S+)\s*$", line)
            if label:
                found[label[1]] = (docname, _label_title(label[1]))
    return found


def _label_title(label: str) -> str:
    if match := EXERCISE_LABEL.match(label):
        return f"Exercise {match[1]}.{int(match[2])}"
    if match := SOLUTION_LABEL.match(label):
        return f"Solution to Exercise {match[1]}.{int(match[2])}"
    return label


@cache
def doc_titles() -> dict[str, str]:
    """``docname -> title`` (the first ``# `` heading) of every chapter, solution and book page."""
    titles = {}
    for path in source_notebooks():
        nb = nbformat.read(path, as_version=4)
        text = "\n".join(cell.source for cell in nb.cells if cell.cell_type == "markdown")
        titles[path.relative_to(ROOT).with_suffix("").as_posix()] = _first_title(text)
    for path in sorted((ROOT / "book").glob("*.md")):
        titles[path.relative_to(ROOT).with_suffix("").as_posix()] = _first_title(path.read_text(encoding="utf-8"))
    return titles


def _first_title(text: str) -> str:
    match = re.search(r"^#\s+(.*)$", text, re.MULTILINE)
    return match[1].strip() if match else ""


@cache
def bibliography() -> dict[str, tuple[str, str]]:
    """``key -> (authors, year)`` of book/references.bib, as the book's author-year citations
    name them: "Shazeer", "Zhang and Sennrich", "Vaswani et al."."""
    from pybtex.database import parse_file
    from pybtex.richtext import Text

    entries = {}
    for key, entry in parse_file(str(ROOT / "book" / "references.bib")).entries.items():
        people = entry.persons.get("author") or entry.persons.get("editor") or []
        names = [Text.from_latex(" ".join(p.prelast_names + p.last_names)).render_as("text") for p in people]
        if not names:
            raise LaunchError(f"book/references.bib: {key} has no author")
        authors = names[0] if len(names) == 1 else " and ".join(names) if len(names) == 2 else f"{names[0]} et al."
        entries[key] = (authors, entry.fields.get("year", "n.d."))
    return entries


# ------------------------------------------------------------------------------ inline roles


class Notebook:
    """What converting one notebook's markdown needs: its name, its glued values."""

    def __init__(self, docname: str, glued: dict[str, dict]):
        self.docname = docname
        self.glued = glued

    def where(self) -> str:
        return f"{self.docname}.ipynb"

    # -- roles -------------------------------------------------------------------------------
    def role(self, name: str, content: str) -> str:
        if name in ("glue", "glue:", "glue:text", "glue:any"):
            return self.glue_text(content, name)
        if name == "glue:md":
            return self.glue_markdown(content)
        if name in ("ref", "numref", "eq"):
            return self.ref(content, name)
        if name == "doc":
            return self.doc(content)
        if name in ("cite", "cite:p", "cite:ps", "cite:t", "cite:ts", "cite:author", "cite:year"):
            return self.cite(content, name)
        if name == "math":
            return f"${content}$"
        if name == "term":
            text, _ = _text_and_target(content)
            return f"[{text}]({page_url('book/glossary')})"
        if name in ("sub", "sup", "kbd", "abbr"):
            return content
        raise LaunchError(f"{self.where()}: the role {{{name}}} has no plain-Jupyter form (book/_ext/launch.py)")

    def _glued(self, key: str) -> dict:
        if "::" in key:
            raise LaunchError(f"{self.where()}: glue from another notebook ({key}) is not supported")
        if key not in self.glued:
            raise LaunchError(f"{self.where()}: no stored glue output named {key!r} (run the notebook)")
        return self.glued[key]

    def glue_text(self, content: str, role: str) -> str:
        key, fmt = (content.rsplit(":", 1) + [""])[:2] if role == "glue:text" else (content, "")
        data = self._glued(key)
        if "text/plain" not in data:
            raise LaunchError(f"{self.where()}: the glued {key!r} has no text/plain value")
        return format_plain_text(data["text/plain"], fmt or "s")

    def glue_markdown(self, content: str) -> str:
        key = content.rsplit(":", 1)[0] if content.count(":") == 1 else content
        data = self._glued(key)
        if "text/markdown" not in data:
            raise LaunchError(f"{self.where()}: the glued {key!r} has no text/markdown value")
        return data["text/markdown"].strip()

    def ref(self, content: str, role: str) -> str:
        text, label = _text_and_target(content)
        if label not in labels():
            raise LaunchError(f"{self.where()}: {{{role}}}`{content}`: no label {label!r} in the book")
        docname, title = labels()[label]
        return f"[{text or title}]({page_url(docname, label)})"

    def doc(self, content: str) -> str:
        text, target = _text_and_target(content)
        docname = (Path(self.docname).parent / target).as_posix()
        docname = _normalise(docname)
        if docname not in doc_titles():
            raise LaunchError(f"{self.where()}: {{doc}}`{content}`: no page {docname!r}")
        return f"[{text or doc_titles()[docname]}]({page_url(docname)})"

    def cite(self, content: str, role: str) -> str:
        """As the book writes them (sphinxcontrib-bibtex's author-year style): ``{cite}`` and
        ``{cite:p}`` "[Vaswani et al., 2017]", ``{cite:t}`` "Vaswani et al. [2017]"; each
        linked to its entry of the bibliography page."""
        keys = [key.strip() for key in content.split(",") if key.strip()]
        unknown = [key for key in keys if key not in bibliography()]
        if unknown:
            raise LaunchError(f"{self.where()}: {{{role}}}`{content}`: not in book/references.bib: {unknown}")
        cited = [(*bibliography()[key], citation_url(key)) for key in keys]
        if role == "cite:author":
            return ", ".join(f"[{authors}]({url})" for authors, _, url in cited)
        if role == "cite:year":
            return ", ".join(f"[{year}]({url})" for _, year, url in cited)
        if role in ("cite:t", "cite:ts"):
            return ", ".join(f"[{authors} [{year}]]({url})" for authors, year, url in cited)
        return "[" + "; ".join(f"[{authors}, {year}]({url})" for authors, year, url in cited) + "]"


def citation_url(key: str) -> str:
    """The bibliography page's entry for ``key``: _config.yml's ``bibtex_cite_id`` is ``cite-{key}``,
    made an HTML id as docutils makes every id."""
    from docutils.nodes import make_id

    return page_url("book/bibliography", make_id(f"cite-{key}"))


def format_plain_text(text: str, fmt_spec: str) -> str:
    """A glued ``text/plain`` value formatted by ``fmt_spec``, exactly as myst-nb formats it for
    ``{glue:text}`` (``myst_nb.core.variables.format_plain_text``)."""
    try:
        value = literal_eval(text)
    except (SyntaxError, ValueError):
        value = text
    if fmt_spec == "":
        return str(value)
    kind = fmt_spec[-1]
    if kind == "s":
        value = str(value)
    elif kind in "bcdoxX":
        value = int(value)
    elif kind in "eEfFgGn%":
        value = float(value)
    return format(value, fmt_spec)


def _text_and_target(content: str) -> tuple[str, str]:
    """``"Solution 01.1 <sol-01-1>"`` -> ``("Solution 01.1", "sol-01-1")``; ``"label"`` -> ``("", "label")``."""
    match = re.match(r"^(.*?)\s*<([^<>]+)>\s*$", content, re.DOTALL)
    if match and match[1]:
        return " ".join(match[1].split()), match[2].strip()
    return "", content.strip()


def _normalise(docname: str) -> str:
    parts: list[str] = []
    for part in docname.split("/"):
        if part == "..":
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/".join(parts).removesuffix(".md").removesuffix(".ipynb")


def convert_inline(text: str, nb: Notebook) -> str:
    """``text`` with every role replaced; code spans, escapes and everything else kept."""
    out, i = [], 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            out.append(text[i:i + 2])
            i += 2
        elif char == "`":
            run = len(text[i:]) - len(text[i:].lstrip("`"))
            close = re.compile(rf"(?<!`)`{{{run}}}(?!`)").search(text, i + run)
            end = close.end() if close else i + run
            out.append(text[i:end])
            i = end
        elif char == "{" and (role := ROLE.match(text, i)):
            out.append(nb.role(role[1], role[3]))
            i = role.end()
        else:
            out.append(char)
            i += 1
    return "".join(out)


def convert_links(text: str, nb: Notebook) -> str:
    """Relative links to the book's pages (``../book/notation.md``) point at the rendered book;
    links to other notebooks stay relative: the launch copies sit side by side as the chapters do."""
    def replace(match: re.Match) -> str:
        target, anchor = (match[2].split("#", 1) + [""])[:2]
        if re.match(r"^[a-z]+:", target) or not target.endswith(".md"):
            return match[0]
        docname = _normalise((Path(nb.docname).parent / target).as_posix())
        return f"]({page_url(docname, anchor)})"
    return re.sub(r"\]\(((?!https?:)([^)\s]+))\)", replace, text)


# ------------------------------------------------------------------------------ blocks


def _split_options(body: list[str]) -> tuple[dict[str, str], list[str]]:
    """A directive's ``:key: value`` option lines (or a ``---`` YAML block), and the rest."""
    options: dict[str, str] = {}
    if body and body[0].strip() == "---":
        end = body.index("---", 1) if "---" in body[1:] else 0
        options = yaml.safe_load("\n".join(body[1:end])) or {}
        return {k: str(v) for k, v in options.items()}, body[end + 1:]
    i = 0
    while i < len(body) and (option := re.match(r"^:([\w-]+):\s*(.*)$", body[i])):
        options[option[1]] = option[2]
        i += 1
    return options, body[i:]


def _quote(markdown: str) -> list[str]:
    return [f"> {line}".rstrip() for line in markdown.split("\n")]


def directive(name: str, argument: str, body: list[str], nb: Notebook) -> list[str]:
    """The plain Markdown for one directive (its body already split into lines)."""
    options, body = _split_options(body)
    content = convert_markdown("\n".join(body), nb).strip("\n")
    if name in ("exercise-start", "exercise"):
        label = options.get("label", "")
        match = EXERCISE_LABEL.match(label)
        if not match:
            raise LaunchError(f"{nb.where()}: an exercise labelled {label!r}, not ex-NN-k")
        title = f"Exercise {match[1]}.{int(match[2])}" + (f": {convert_inline(argument, nb)}" if argument else "")
        return [f"### {title}", *([""] + content.split("\n") if content else [])]
    if name in ("solution-start", "solution"):
        match = EXERCISE_LABEL.match(argument.strip())
        if not match:
            raise LaunchError(f"{nb.where()}: a solution to {argument!r}, not to an ex-NN-k exercise")
        exercise = f"Exercise {match[1]}.{int(match[2])}"
        docname, _ = labels().get(match[0], ("", ""))
        link = f"[{exercise}]({page_url(docname, match[0])})" if docname else exercise
        return [f"### Solution to {link}", *([""] + content.split("\n") if content else [])]
    if name in ("exercise-end", "solution-end"):
        return []
    if name in ADMONITIONS:
        title = convert_inline(argument, nb) if argument else ("See also" if name == "seealso" else name.capitalize())
        if name == "dropdown" or "dropdown" in options.get("class", "").split():
            # a collapsed answer stays collapsed: Jupyter, JupyterLab and Colab render HTML <details>
            return ["<details>", f"<summary><b>{title}</b></summary>", "", *content.split("\n"), "", "</details>"]
        return _quote(f"**{title}**" + (f"\n\n{content}" if content else ""))
    if name == "math":
        return ["$$", *body, "$$"]
    raise LaunchError(f"{nb.where()}: the directive {{{name}}} has no plain-Jupyter form (book/_ext/launch.py)")


def _closes(line: str, marker: str) -> bool:
    match = FENCE.match(line)
    return bool(match and match["marker"][0] == marker[0] and len(match["marker"]) >= len(marker)
                and not match["info"])


def convert_markdown(text: str, nb: Notebook) -> str:
    """A markdown cell's MyST source as plain (Jupyter) Markdown."""
    lines = text.split("\n")
    out: list[str] = []
    prose: list[str] = []

    def flush() -> None:
        if prose:
            out.extend(convert_links(convert_inline("\n".join(prose), nb), nb).split("\n"))
            prose.clear()

    i, skip_blank = 0, False
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence and fence["marker"][0] == ":" and not fence["info"]:
            raise LaunchError(f"{nb.where()}: a colon fence without a directive: {line!r}")
        if fence:
            flush()
            marker, info = fence["marker"], fence["info"]
            body, j, code = [], i + 1, None  # code: the marker of a code block inside a colon fence
            while j < len(lines):
                if code is None and _closes(lines[j], marker):
                    break
                nested = FENCE.match(lines[j])
                if code is not None and _closes(lines[j], code):
                    code = None
                elif code is None and marker[0] == ":" and nested and nested["marker"][0] != ":":
                    code = nested["marker"]
                body.append(lines[j])
                j += 1
            is_directive = DIRECTIVE.match(info)
            if is_directive:
                shown = directive(is_directive["name"], is_directive["argument"].strip(), body, nb)
                out.extend(shown)
                skip_blank = not shown
            elif marker[0] == ":":
                raise LaunchError(f"{nb.where()}: a colon fence {line!r} that is not a directive")
            else:
                out.extend(lines[i:j + 1])  # a code block, verbatim
            i = j + 1
        elif TARGET.match(line) or re.match(r"^%", line):
            flush()  # a label (the book's anchor) or a MyST comment: nothing to show
            i += 1
            skip_blank = True
        elif skip_blank and not line.strip() and (not out or not out[-1].strip()):
            i += 1  # one blank line where a removed block was, not two
        else:
            skip_blank = False
            prose.append(line)
            i += 1
    flush()
    return "\n".join(out)


# ------------------------------------------------------------------------------ notebooks


@cache
def extras() -> dict[str, set[str]]:
    """``extra -> the import names of its packages``, from pyproject.toml (the book's own ``book``
    extra and the ``test`` extra excluded: every launch installs ``book``, none needs ``test``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    found = {}
    for extra, requirements in project.get("optional-dependencies", {}).items():
        if extra in ("book", "test"):
            continue
        names = {re.match(r"^[A-Za-z0-9_.-]+", req)[0] for req in requirements if not req.startswith("attnlib")}
        found[extra] = {import_name for name in names for import_name in _import_names(name)}
    return found


def _import_names(distribution: str) -> set[str]:
    from importlib.metadata import packages_distributions

    names = {top for top, dists in packages_distributions().items()
             if any(d.lower().replace("_", "-") == distribution.lower().replace("_", "-") for d in dists)}
    return names or {distribution.lower().replace("-", "_")}


def _imports(source: str, late: bool = True) -> set[str]:
    """Absolute module names a piece of Python imports: anywhere, or (``late=False``) outside function bodies,
    leaving out what a function imports only when it is called (an optional dependency, such as
    ``transformers`` for the benchmark against it)."""
    lines = [line for line in source.split("\n") if not line.lstrip().startswith(("%", "!"))]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return set()
    found = set()
    nodes = ast.walk(tree) if late else _outside_functions(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _outside_functions(tree: ast.AST):
    """Every node of ``tree`` but those inside a function's body."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def imported_packages(nb: nbformat.NotebookNode) -> set[str]:
    """Top-level packages a notebook imports, directly (anywhere in its cells) or through the attnlib modules
    it imports (what importing them runs: imports outside function bodies; read from this checkout's
    sources, nothing is imported)."""
    todo = set().union(*(_imports(cell.source) for cell in nb.cells if cell.cell_type == "code"))
    seen: set[str] = set()
    packages = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        if module.split(".")[0] != "attnlib":
            packages.add(module.split(".")[0])
            continue
        for path in _module_files(module):
            todo |= _file_imports(path)
    return packages


@cache
def _file_imports(path: Path) -> set[str]:
    return _imports(path.read_text(encoding="utf-8"), late=False)


def _module_files(module: str) -> list[Path]:
    """The source files that importing ``module`` (``attnlib.x.y``) runs: its packages' ``__init__``
    files and its own file, where they exist (``attnlib.x.y`` may name a function of ``attnlib.x``)."""
    parts = module.split(".")
    files = []
    for n in range(1, len(parts) + 1):
        base = ROOT.joinpath(*parts[:n])
        for path in (base / "__init__.py", base.with_suffix(".py")):
            if path.is_file():
                files.append(path)
    return files


def needed_extras(nb: nbformat.NotebookNode) -> list[str]:
    packages = imported_packages(nb)
    return ["book"] + sorted(extra for extra, names in extras().items() if names & packages)


def install_cell(extra_names: list[str]) -> nbformat.NotebookNode:
    requirement = f"attnlib[{','.join(extra_names)}]"
    source = f'''\
# Installs the book's library and what this notebook imports, where attnlib is missing
# (Colab, a fresh Jupyter); where it is importable (Binder, a clone) it does nothing.
import importlib
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("attnlib") is None:
    repo = "git+{REPOSITORY}"
    where = os.environ.get("ATTNLIB_INSTALL_FROM", repo)  # or a wheel, a local path
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"{requirement} @ {{where}}"], check=True)
    importlib.invalidate_caches()'''
    cell = nbformat.v4.new_code_cell(source)
    cell.id = INSTALL_CELL_ID
    return cell


def _glue_outputs(cell: nbformat.NotebookNode) -> tuple[list, dict[str, dict]]:
    """The cell's outputs without the glue records, and the glued data by name (mime prefix removed)."""
    kept, glued = [], {}
    for output in cell.get("outputs", []):
        record = output.get("metadata", {}).get("scrapbook")
        if not record:
            kept.append(output)
            continue
        prefix = len(record.get("mime_prefix", ""))
        glued[record["name"]] = {mime[prefix:]: value for mime, value in output.get("data", {}).items()}
        if not prefix:
            kept.append(output)  # a glue that is also displayed
    return kept, glued


def convert_notebook(path: Path) -> nbformat.NotebookNode:
    """The launch copy of the notebook at ``path``."""
    source = nbformat.read(path, as_version=4)
    nb = copy.deepcopy(source)
    glued: dict[str, dict] = {}
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, found = _glue_outputs(cell)
            glued.update(found)
    notebook = Notebook(path.relative_to(ROOT).with_suffix("").as_posix(), glued)

    cells = []
    for cell in nb.cells:
        book_metadata = cell.metadata.pop("mystnb", {})
        if cell.get("id") == INSTALL_CELL_ID:
            cells.append(install_cell(needed_extras(source)))
            continue
        if cell.cell_type == "markdown":
            cell.source = convert_markdown(cell.source, notebook)
            if not cell.source.strip():
                continue
        cells.append(cell)
        caption = book_metadata.get("figure", {}).get("caption")
        if caption:
            text = convert_inline(caption, notebook).strip()
            figure = nbformat.v4.new_markdown_cell(f"*Figure: {text}*")
            figure.id = f"{cell.get('id', 'cell')}-caption"[:64]
            cells.append(figure)
    if not cells or cells[0].get("id") != INSTALL_CELL_ID:
        raise LaunchError(f"{notebook.where()}: the first cell is not the install cell ({INSTALL_CELL_ID})")
    nb.cells = cells
    return nb


def launch_path(path: Path, out: Path) -> Path:
    return out / path.relative_to(ROOT)


def write_all(out: Path | None = None) -> list[Path]:
    """Write the launch copy of every chapter and solution under ``out`` (default ``launch/``), and
    remove the copies of notebooks that are gone."""
    out = out or ROOT / LAUNCH
    written = []
    for path in source_notebooks():
        target = launch_path(path, out)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(nbformat.writes(convert_notebook(path)) + "\n", encoding="utf-8")
        written.append(target)
    for folder in SOURCES:
        for orphan in set((out / folder).glob("*.ipynb")) - set(written):
            orphan.unlink()
    return written


def stale(out: Path | None = None) -> list[str]:
    """The launch copies under ``out`` that differ from what :func:`write_all` would write now, or are
    missing, or have no chapter any more."""
    out = out or ROOT / LAUNCH
    problems = []
    expected = {launch_path(path, out): nbformat.writes(convert_notebook(path)) + "\n" for path in source_notebooks()}
    for target, text in expected.items():
        if not target.is_file():
            problems.append(f"{target.relative_to(out)} is missing")
        elif target.read_text(encoding="utf-8") != text:
            problems.append(f"{target.relative_to(out)} is stale")
    for target in sorted(out.glob("*/*.ipynb")):
        if target not in expected:
            problems.append(f"{target.relative_to(out)} has no chapter or solution")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed copies are stale")
    parser.add_argument("--out", type=Path, default=ROOT / LAUNCH, help="where to write (default launch/)")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale(args.out)
        for problem in problems:
            print(f"{problem}: run `make launch`", file=sys.stderr)
        return 1 if problems else 0
    for target in write_all(args.out):
        print(target.relative_to(args.out.parent) if args.out.parent in target.parents else target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
