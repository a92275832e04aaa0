"""The package's layout (issue 11, part 1), read from the source with ``ast``, nothing imported.

* no import cycle among attnlib's modules, counting every import at any depth (inside
  functions, ``if TYPE_CHECKING`` blocks, ``if __name__ == "__main__"`` blocks);
* the core (everything outside ``attnlib.book`` and ``attnlib.bench``) imports no tooling;
* ``attnlib.bench`` imports nothing of ``attnlib.book``;
* no module is longer than 350 lines.

``from attnlib.x import y`` is an edge to ``attnlib.x``, and also to ``attnlib.x.y`` when that
is a module. Importing ``attnlib.x.y`` runs ``attnlib/__init__.py`` and ``attnlib/x/__init__.py``
first, but those edges are left out: every module would otherwise sit in a cycle with the
package ``__init__`` that imports it. A package ``__init__``'s own imports are edges like any other.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import attnlib

PACKAGE = Path(attnlib.__file__).resolve().parent
MAX_LINES = 350
TOOLING = ("attnlib.book", "attnlib.bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports_of(name: str) -> set[str]:
    """The attnlib modules ``name`` imports, anywhere in its source."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"), filename=str(MODULES[name]))
    package = name if is_package(name) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from ..y import z
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # the longest attnlib module the name denotes (import attnlib.a.b.c where c is a function)
            while target and target not in MODULES and "." in target:
                target = target.rpartition(".")[0]
            if target in MODULES and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, for the failure message."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_the_parser_sees_every_kind_of_import(tmp_path):
    """The helpers above, on a made-up package: late, relative and from-imports all count."""
    assert "attnlib" in MODULES and "attnlib.book.exercises.__main__" in MODULES
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": {"e"}}
    assert sorted(map(sorted, map(set, find_cycles(graph)))) == [["a", "b", "c"], ["e", "e2"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    # a late import inside a function body of a real module is found (train's command line imports the model)
    assert "attnlib.models.decoder" in GRAPH["attnlib.train"]


def test_no_import_cycles():
    cycles = find_cycles(GRAPH)
    assert not cycles, "import cycles (late imports included):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_core_imports_no_tooling():
    core = [name for name in MODULES if not any(within(name, t) for t in TOOLING)]
    bad = sorted(f"{name} imports {target}" for name in core for target in GRAPH[name]
                 if any(within(target, t) for t in TOOLING))
    assert not bad, "\n".join(bad)


def test_the_benchmarks_import_nothing_of_the_book():
    bad = sorted(f"{name} imports {target}" for name in MODULES if within(name, "attnlib.bench")
                 for target in GRAPH[name] if within(target, "attnlib.book"))
    assert not bad, "\n".join(bad)


def reachable(start: str) -> set[str]:
    """Every attnlib module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in GRAPH[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_models_import_no_serving_code():
    """Issue 21: the decoder drives no scheduler; serving builds on the models, never the reverse."""
    bad = sorted(f"{name} reaches {target}" for name in MODULES if within(name, "attnlib.models")
                 for target in reachable(name) if within(target, "attnlib.serving"))
    assert not bad, "\n".join(bad)


CACHE_CLASSES = {node.name for name, path in MODULES.items() if within(name, "attnlib.cache")
                 for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.ClassDef)}


def class_names(node: ast.expr) -> set[str]:
    """The names in an isinstance() class argument: ``C``, ``mod.C``, or a tuple of them."""
    if isinstance(node, ast.Tuple):
        return set().union(*(class_names(e) for e in node.elts))
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return {node.id} if isinstance(node, ast.Name) else set()


def test_no_isinstance_on_cache_classes_outside_the_cache_package():
    """Issue 21: the core (attention above all) never checks a cache's class; a cache says what it does through
    the protocol. (The book's exercise checks may ask whether a learner returned a KVCache.)"""
    assert {"LayerCache", "RingLayerCache", "SinkLayerCache", "PagedLayerCache", "KVCache", "RecurrentState"} <= CACHE_CLASSES
    bad = []
    for name, path in MODULES.items():
        if within(name, "attnlib.cache") or any(within(name, t) for t in TOOLING):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass") \
                    and len(node.args) == 2 and class_names(node.args[1]) & CACHE_CLASSES:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not bad, "isinstance checks on cache classes:\n" + "\n".join(bad)


def test_no_constructor_is_skipped():
    """Issue 21: no ``Parent.__init__(self)`` that bypasses a class's own parent (``nn.Module.__init__(self)``)."""
    bad = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__" \
                    and not (isinstance(node.func.value, ast.Call) and getattr(node.func.value.func, "id", "") == "super"):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not bad, "constructors called by name instead of super().__init__:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_350_lines(name):
    n_lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert n_lines <= MAX_LINES, f"{MODULES[name]} has {n_lines} lines (at most {MAX_LINES}): split it"


def test_no_path_from_dunder_file():
    """Data, results and notebooks are found through arguments or importlib.resources, never __file__'s parents."""
    bad = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Name) and node.id == "__file__":
                bad.append(f"{path}:{node.lineno}")
    assert not bad, "modules computing paths from __file__:\n" + "\n".join(bad)


# ------------------------------------------------------------------ the build (issue 11, part 7)

REPO = PACKAGE.parent


def make_target(name: str) -> tuple[list[str], list[str]]:
    """``(prerequisites, recipe lines)`` of a Makefile target."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{name}:"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return lines[start].split(":", 1)[1].split(), recipe


def test_the_strict_build_config_is_config_yml_with_execution_off():
    yaml = pytest.importorskip("yaml")
    main = yaml.safe_load((REPO / "_config.yml").read_text())
    strict = yaml.safe_load((REPO / "_config.strict.yml").read_text())
    assert strict["execute"].pop("execute_notebooks") == "off"
    main["execute"].pop("execute_notebooks")
    assert strict == main, "_config.strict.yml must equal _config.yml except execute.execute_notebooks"
    _, recipe = make_target("book-strict")
    assert any("--config _config.strict.yml" in line for line in recipe) and not any("sed" in line for line in recipe)


def test_make_test_installs_no_browser_and_ci_installs_it_first():
    prerequisites, _ = make_target("browser")
    assert "chromium" not in prerequisites and "chromium" not in make_target("test")[0]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci.index("make chromium") < ci.index("make test")


def test_the_github_gpu_job_runs_make_gpu():
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "ci.yml").read_text())
    runs = [step["run"].strip() for step in workflow["jobs"]["gpu"]["steps"] if "run" in step]
    assert runs[-1] == "make gpu", runs
    assert not any("pytest" in r or "attnlib.bench" in r or "pip install" in r for r in runs[:-1]), runs
    _, recipe = make_target("gpu")
    assert any("--nbval-lax" in line for line in recipe) and any("attnlib.bench" in line for line in recipe)
