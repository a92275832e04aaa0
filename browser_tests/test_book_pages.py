"""Every page of the built book, as a reader's browser shows it (headless Chromium).

For each page of ``_toc.yml``: no request leaves localhost, no console error and no failed
local request, every formula typeset by MathJax without error, every internal link and
anchor resolves, every exercise and solution block of the source is rendered, notebook pages
have their download, launch and repository buttons; a screenshot is saved per page. Then the
search page finds a word, and the attention explorer of chapter 12 switches heatmaps without
a kernel.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml
from conftest import HTML, ROOT

LOCAL_HOSTS = {"127.0.0.1", "localhost"}
EXERCISE = re.compile(r"(?:```|:::)\{exercise(?:-start)?\}")
SOLUTION = re.compile(r"(?:```|:::)\{solution(?:-start)?\}")


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part["chapters"]]
    return files


PAGES = toc_files()


def source_text(page: str) -> str:
    """The markdown of a page's source (a notebook's markdown cells, or the .md file)."""
    path = ROOT / f"{page}.ipynb"
    if path.exists():
        nb = json.loads(path.read_text(encoding="utf-8"))
        return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    return (ROOT / f"{page}.md").read_text(encoding="utf-8")


@functools.cache
def ids_in(html_file: Path) -> frozenset[str]:
    return frozenset(re.findall(r'\bid="([^"]+)"', html_file.read_text(encoding="utf-8")))


def broken_links(hrefs: list[str], site: str) -> list[str]:
    """The local hrefs whose file, or whose #anchor in that file, does not exist in _build/html."""
    broken = []
    for href in sorted(set(hrefs)):
        if not href.startswith(site + "/"):
            continue
        parts = urlsplit(href)
        path = unquote(parts.path).lstrip("/")
        target = HTML / (path + "index.html" if path.endswith("/") or not path else path)
        if not target.is_file():
            broken.append(f"{href} (no file)")
        elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in ids_in(target):
            broken.append(f"{href} (no anchor #{parts.fragment})")
    return broken


def open_page(browser, site: str, path: str):
    """A new page at ``path``; returns (page, problems) where problems collects what went wrong."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    problems: list[str] = []

    def only_localhost(route):
        if urlsplit(route.request.url).hostname in LOCAL_HOSTS:
            route.continue_()
        else:
            problems.append(f"request leaves localhost: {route.request.url}")
            route.abort()

    context.route("**/*", only_localhost)
    page = context.new_page()
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    page.goto(f"{site}/{path}", wait_until="load")
    return page, problems


def check_math(page, problems: list[str]) -> int:
    """Wait for MathJax; every ``.math`` node must hold typeset output and no MathJax error."""
    n_math = page.locator(".math").count()
    if n_math:
        page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=60_000)
        page.evaluate("() => MathJax.startup.promise.then(() => true)")
        untypeset = page.evaluate(
            "() => [...document.querySelectorAll('.math')].filter(e => !e.querySelector('mjx-container'))"
            ".map(e => e.textContent.slice(0, 60))"
        )
        problems += [f"math not typeset: {text!r}" for text in untypeset]
        errors = page.evaluate("() => [...document.querySelectorAll('mjx-merror')].map(e => e.textContent)")
        problems += [f"MathJax error: {text!r}" for text in errors]
    return n_math


@pytest.mark.parametrize("name", PAGES)
def test_page(name, browser, site, screenshots):
    page, problems = open_page(browser, site, f"{name}.html")
    check_math(page, problems)

    hrefs = page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
    problems += [f"broken link: {b}" for b in broken_links(hrefs, site)]

    source = source_text(name)
    for kind, pattern in (("exercise", EXERCISE), ("solution", SOLUTION)):
        expected, shown = len(pattern.findall(source)), page.locator(f"div.{kind}").count()
        if expected != shown:
            problems.append(f"{expected} {kind} blocks in the source, {shown} rendered")
        titles = page.eval_on_selector_all(f"div.{kind} > .admonition-title", "els => els.map(e => e.textContent)")
        problems += [f"{kind} block without a title" for t in titles if kind.capitalize() not in t]

    if (ROOT / f"{name}.ipynb").exists():  # download, launch and repository buttons
        for what, selector in (
            ("download (.ipynb)", "a[href$='.ipynb'][href*='_sources']"),
            ("Binder launch", "a[href*='mybinder.org']"),
            ("Colab launch", "a[href*='colab.research.google.com']"),
            ("repository", "a[href*='github.com/attention-from-scratch']"),
        ):
            if not page.locator(selector).count():
                problems.append(f"no {what} button")

    page.screenshot(path=str(screenshots / f"{name.replace('/', '__')}.png"))
    page.context.close()
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)


def test_search_finds_a_word(browser, site):
    page, problems = open_page(browser, site, "search.html?q=softmax")
    page.wait_for_selector("#search-results li", timeout=60_000)
    results = page.eval_on_selector_all("#search-results li a", "els => els.map(e => e.href)")
    assert any("notebooks/" in href for href in results), results
    assert not broken_links(results, site)
    page.context.close()
    assert not problems, problems


VISIBLE_HEATMAPS = (
    "[...document.querySelectorAll('.jupyter-widgets img')].filter(img => img.offsetParent !== null).map(img => img.src)"
)


def visible_heatmap(page, other_than: str | None = None) -> str:
    """The ``src`` of the one explorer heatmap shown (once it differs from ``other_than``)."""
    if other_than is not None:
        page.wait_for_function(
            f"old => {{ const s = {VISIBLE_HEATMAPS}; return s.length === 1 && s[0] !== old; }}",
            arg=other_than,
            timeout=10_000,
        )
    shown = page.evaluate(f"() => {VISIBLE_HEATMAPS}")
    assert len(shown) == 1, f"{len(shown)} heatmaps visible"
    return shown[0]


def test_attention_explorer_works_without_a_kernel(browser, site, screenshots):
    page, problems = open_page(browser, site, "notebooks/12_gpt.html")
    page.wait_for_selector(".jupyter-widgets img", state="visible", timeout=60_000)
    explorer = page.locator(".widget-vbox").filter(has=page.locator("img")).first
    explorer.scroll_into_view_if_needed()
    explorer.screenshot(path=str(screenshots / "explorer.png"))
    first = visible_heatmap(page)

    explorer.locator("select").first.select_option(index=1)  # the text dropdown: a new text
    second = visible_heatmap(page, other_than=first)
    explorer.locator(".noUi-handle").first.press("ArrowRight")  # the layer slider: 0 -> 1
    third = visible_heatmap(page, other_than=second)
    explorer.locator(".noUi-handle").nth(1).press("ArrowRight")  # the head slider: 0 -> 1
    fourth = visible_heatmap(page, other_than=third)
    assert len({first, second, third, fourth}) == 4
    page.context.close()
    assert not problems, problems
