"""Every page of the built book, as a reader's browser shows it (headless Chromium).

For each page of ``_toc.yml``, at 1280 px in light mode: no request leaves localhost, no
console error and no failed local request, every formula typeset by MathJax without error and
without a visible backslash (``\\_`` inside ``\\text{}``, an unknown macro), no display formula
wider than its column, every internal link and anchor resolves, every exercise and solution
block of the source is rendered and numbered ``NN.k`` as its label ``ex-NN-k`` says (box
title, solution title, references), notebook pages have their download, launch and
repository buttons; a screenshot is saved per page. At 390 px in dark mode (a phone): no page
is wider than the screen; a screenshot per page in ``phone/``. Over the whole book, fewer than
5% of code cells and outputs scroll sideways at 1280 px. Then the search page finds a word,
and the attention explorer of chapter 12 switches heatmaps without a kernel.

On every page, at 1280 px and at 390 px: no paragraph holds a Markdown table row (a table that
did not render), every image is shown with its own aspect ratio (within 2%), and every image has
alt text that says something (not empty, not a file path). Notebook pages launch and download the
plain-Jupyter copy (``launch/<page>.ipynb``), and each figure has a caption numbered
"Fig. NN.k" after its chapter.
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
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}  # an iPhone 12-15's CSS pixels
MAX_SCROLLING_FRACTION = 0.05  # of code cells and outputs, at 1280 px
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


def open_page(browser, site: str, path: str, viewport: dict | None = None, dark: bool = False, touch: bool = False):
    """A new page at ``path``; returns (page, problems) where problems collects what went wrong.

    ``viewport``: CSS pixels (default :data:`DESKTOP`); ``dark``: the reader's system asks for a
    dark theme (the book follows it: ``default_mode: auto``); ``touch``: a touch screen (for
    ``locator.tap()``)."""
    context = browser.new_context(
        viewport=viewport or DESKTOP, color_scheme="dark" if dark else "light", has_touch=touch)
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
        # What the reader sees is the MathML MathJax built from the TeX (its token elements
        # hold the characters drawn): a backslash there is a macro MathJax did not expand,
        # such as \_ inside \text{} or an unknown command.
        backslashes = page.evaluate(
            "() => [...MathJax.startup.document.math].filter(m => new DOMParser()"
            ".parseFromString(MathJax.startup.toMML(m.root), 'text/html').body.textContent.includes('\\\\'))"
            ".map(m => m.math.trim().slice(0, 80))"
        )
        problems += [f"backslash shown in math: {tex!r}" for tex in backslashes]
    return n_math


def expand_everything(page) -> None:
    """Open every collapsed part (solutions' dropdowns, hidden cells) so that it can be measured."""
    page.evaluate(
        "() => { document.querySelectorAll('details').forEach(d => d.open = true);"
        " document.querySelectorAll('.toggle-hidden').forEach(e => e.classList.remove('toggle-hidden')); }"
    )


def wide_display_math(page) -> list[str]:
    """TeX of the display formulas wider than their column (they scroll inside it)."""
    return page.evaluate(
        "() => [...MathJax.startup.document.math].filter(m => m.display && m.typesetRoot"
        " && m.typesetRoot.scrollWidth > m.typesetRoot.clientWidth + 1)"
        ".map(m => `${m.typesetRoot.scrollWidth} px in ${m.typesetRoot.clientWidth} px: ${m.math.trim().slice(0, 70)}`)"
    )


#: page -> (code blocks, outputs, of which scroll sideways: code blocks, outputs, their first lines)
SCROLLING: dict[str, tuple[int, int, int, int, list[str]]] = {}


def measure_scrolling(page, name: str) -> tuple[int, int, int, int, list[str]]:
    """Count the code cells' and outputs' ``pre`` elements that scroll sideways (page expanded)."""
    result = page.evaluate(
        """() => {
          const counts = [0, 0, 0, 0], scrolling = [];
          for (const pre of document.querySelectorAll('article div.cell pre')) {
            if (pre.closest('.jupyter-widgets')) continue;
            const output = pre.closest('.cell_output') !== null;
            counts[output ? 1 : 0] += 1;
            if (pre.scrollWidth > pre.clientWidth + 1) {
              counts[output ? 3 : 2] += 1;
              const longest = pre.textContent.split('\\n').reduce((a, b) => (b.length > a.length ? b : a), '');
              scrolling.push(`${output ? 'output' : 'code'} (${longest.length} characters): ${longest.trim().slice(0, 60)}`);
            }
          }
          return [...counts, scrolling];
        }"""
    )
    SCROLLING[name] = tuple(result)
    return SCROLLING[name]


def launch_problems(page, name: str) -> list[str]:
    """A notebook page's Colab and Binder buttons open ``launch/<page>.ipynb``, the plain-Jupyter
    copy, and its ``.ipynb`` download is that copy."""
    problems = []
    target = f"/launch/{name}.ipynb"
    for what, selector in (("Binder", "a[href*='mybinder.org']"), ("Colab", "a[href*='colab.research.google.com']")):
        hrefs = page.eval_on_selector_all(selector, "els => els.map(e => e.href)")
        problems += [f"the {what} button opens {href}, not {target}" for href in hrefs if not href.endswith(target)]
    launch_copy = ROOT / "launch" / f"{name}.ipynb"
    for href in page.eval_on_selector_all("a[href$='.ipynb'][href*='_sources']", "els => els.map(e => e.href)"):
        served = HTML / unquote(urlsplit(href).path).lstrip("/")
        if not launch_copy.is_file() or not served.is_file() or served.read_bytes() != launch_copy.read_bytes():
            problems.append(f"the download {href} is not launch/{name}.ipynb")
    return problems


EXERCISE_TITLE = re.compile(r"Exercise (\d\d)\.(\d+)\b")
EXERCISE_LABEL = re.compile(r"ex-(\d\d)-(\d+)")
SOLUTION_LABEL = re.compile(r"sol-(\d\d)-(\d+)")


#: A Markdown table left as text: its delimiter row, ``|---|`` (or ``|—|`` after CommonMark's
#: typography turned the dashes into a dash). Every Markdown table has one; any table, not today's.
TABLE_ROW_IN_TEXT = r"\|\s*:?(?:-{3,}|—|–)"


def markdown_tables_as_text(page) -> list[str]:
    """Paragraphs whose text holds a Markdown table row: a table that was not rendered as one."""
    return page.evaluate(
        f"() => [...document.querySelectorAll('article p')].map(p => p.textContent)"
        f".filter(t => new RegExp({TABLE_ROW_IN_TEXT!r}).test(t)).map(t => t.trim().slice(0, 80))")


#: How far an image's shown width/height may be from its natural width/height.
ASPECT_TOLERANCE = 0.02


def image_problems(page) -> list[str]:
    """Shown images whose aspect ratio is not their own (squashed), or whose alt text says
    nothing: empty, or a file path (a ``/`` or an image file's name)."""
    images = page.evaluate(
        """() => [...document.querySelectorAll('img')].map(img => {
             // the drawn image: the box less its padding and border (the dark theme pads images)
             const r = img.getBoundingClientRect(), cs = getComputedStyle(img), px = v => parseFloat(v) || 0;
             const w = r.width - px(cs.paddingLeft) - px(cs.paddingRight) - px(cs.borderLeftWidth) - px(cs.borderRightWidth);
             const h = r.height - px(cs.paddingTop) - px(cs.paddingBottom) - px(cs.borderTopWidth) - px(cs.borderBottomWidth);
             return {src: img.getAttribute('src') || '', alt: img.getAttribute('alt'), shown: img.offsetParent !== null,
                     complete: img.complete, w: w, h: h, nw: img.naturalWidth, nh: img.naturalHeight};
           })"""
    )
    problems = []
    for img in images:
        name = img["src"].rsplit("/", 1)[-1][:24]
        alt = (img["alt"] or "").strip()
        if not alt or "/" in alt or re.search(r"\.(png|jpe?g|svg|gif)\b", alt, re.IGNORECASE):
            problems.append(f"image {name}: alt text {img['alt']!r} says nothing")
        if img["shown"] and img["complete"] and img["nw"] and img["nh"] and img["w"] > 1 and img["h"] > 1:
            shown, natural = img["w"] / img["h"], img["nw"] / img["nh"]
            if abs(shown / natural - 1) > ASPECT_TOLERANCE:
                problems.append(f"image {name}: shown {img['w']:.0f}x{img['h']:.0f} px, its own ratio is "
                                f"{img['nw']}x{img['nh']} ({shown / natural - 1:+.0%})")
    return problems


def exercise_numbers(page, name: str) -> list[str]:
    """Problems with the numbers of the page's exercises, solutions and references to them.

    An exercise labelled ``ex-NN-k`` (chapter NN's page) must be titled "Exercise NN.k ...", its
    solution "Solution to Exercise NN.k ..." linking to ``#ex-NN-k``, and a link to ``#ex-NN-k``
    or ``#sol-NN-k`` that names a number must name ``NN.k``."""
    problems = []
    chapter = re.match(r"(?:notebooks|solutions)/(\d\d)_", name)
    boxes = page.evaluate(
        """() => [...document.querySelectorAll('div.exercise, div.solution')].map(e => ({
             kind: e.classList.contains('exercise') ? 'exercise' : 'solution', id: e.id,
             title: (e.querySelector(':scope > .admonition-title') || {}).textContent || '',
             link: ((e.querySelector(':scope > .admonition-title a[href]') || {}).href || '')}))"""
    )
    for box in boxes:
        title = " ".join(box["title"].split())
        number = EXERCISE_TITLE.search(title)
        if box["kind"] == "exercise":
            label = EXERCISE_LABEL.fullmatch(box["id"])
            if not label:
                problems.append(f"exercise label {box['id']!r} is not ex-NN-k")
            elif not title.startswith("Exercise ") or not number or number.groups() != label.groups():
                problems.append(f"exercise {box['id']} is titled {title!r}, not 'Exercise {label[1]}.{label[2]}'")
            elif chapter and label[1] != chapter[1]:
                problems.append(f"exercise {box['id']} on chapter {chapter[1]}'s page")
        else:
            target = EXERCISE_LABEL.search(urlsplit(box["link"]).fragment)
            if not target:
                problems.append(f"solution {box['id']} ({title!r}) does not link to an ex-NN-k exercise")
            elif not title.startswith("Solution to Exercise ") or not number or number.groups() != target.groups():
                problems.append(f"solution to {target[0]} is titled {title!r}")
    links = page.eval_on_selector_all(
        "article a[href*='#ex-'], article a[href*='#sol-']", "els => els.map(e => [e.href, e.textContent])"
    )
    for href, text in links:
        fragment = urlsplit(href).fragment
        label = EXERCISE_LABEL.fullmatch(fragment) or SOLUTION_LABEL.fullmatch(fragment)
        shown = re.search(r"(\d\d)\.(\d+)", text)
        if label and shown and shown.groups() != label.groups():
            problems.append(f"link to #{fragment} says {' '.join(text.split())!r}")
    return problems


@pytest.mark.parametrize("name", PAGES)
def test_page(name, browser, site, screenshots):
    page, problems = open_page(browser, site, f"{name}.html")
    n_math = check_math(page, problems)

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
        problems += launch_problems(page, name)
        numbers = page.eval_on_selector_all("figcaption .caption-number", "els => els.map(e => e.textContent.trim())")
        chapter = re.match(r"(?:notebooks|solutions)/(\d\d)_", name)
        if chapter:  # a chapter's figures are numbered after it; a reference page's are not chapter-numbered
            problems += [f"figure numbered {n!r}, not 'Fig. {chapter[1]}.k'" for n in numbers
                         if not re.fullmatch(rf"Fig\. {chapter[1]}\.\d+", n)]
        problems += [f"figure without a caption: {n}" for n in page.evaluate(
            "() => [...document.querySelectorAll('article div.cell_output img')].filter(img => img.offsetParent !== null"
            " && !img.closest('.jupyter-widgets') && !img.closest('figure')?.querySelector('figcaption'))"
            ".map(img => (img.getAttribute('src') || '').split('/').pop())")]

    problems += [f"a Markdown table shown as text: {t!r}" for t in markdown_tables_as_text(page)]
    problems += image_problems(page)

    problems += exercise_numbers(page, name)

    page.screenshot(path=str(screenshots / f"{name.replace('/', '__')}.png"))
    expand_everything(page)
    if n_math:
        problems += [f"display formula wider than its column: {w}" for w in wide_display_math(page)]
    measure_scrolling(page, name)
    page.context.close()
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("name", PAGES)
def test_page_fits_a_phone(name, browser, site, screenshots):
    """At 390 px, in dark mode: the page is no wider than the screen (a code block or a table may
    scroll inside itself; the page may not), every image keeps its aspect ratio and has alt text,
    no table is left as text, and the page loads without errors. Screenshot in ``phone/``."""
    page, problems = open_page(browser, site, f"{name}.html", viewport=PHONE, dark=True)
    width = page.evaluate("() => document.documentElement.scrollWidth")
    if width > PHONE["width"] + 1:
        problems.append(f"the page is {width} px wide on a {PHONE['width']} px screen: " + "; ".join(
            page.evaluate(WIDER_THAN_SCREEN, PHONE["width"])))
    problems += image_problems(page)
    problems += [f"a Markdown table shown as text: {t!r}" for t in markdown_tables_as_text(page)]
    (screenshots / "phone").mkdir(exist_ok=True)
    page.screenshot(path=str(screenshots / "phone" / f"{name.replace('/', '__')}.png"))
    page.context.close()
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)


# The elements that stick out of the screen, outside any element that scrolls or clips them.
WIDER_THAN_SCREEN = """width => {
  const inScroller = e => { for (let a = e; a; a = a.parentElement) { const style = getComputedStyle(a);
    if (style.position === 'fixed' || style.visibility === 'hidden' || (a !== e && style.overflowX !== 'visible'))
      return true; } return false; };
  return [...document.querySelectorAll('body *')]
    .filter(e => e.getBoundingClientRect().right > width + 1 && !inScroller(e))
    .filter(e => !e.parentElement || e.parentElement.getBoundingClientRect().right <= width + 1 || e.parentElement === document.body)
    .slice(0, 5).map(e => `<${e.tagName.toLowerCase()} class="${e.className}"> ${e.textContent.trim().slice(0, 60)}`);
}"""


def test_few_code_cells_scroll_sideways(browser, site):
    """Over the whole book, fewer than 5% of code cells and outputs scroll sideways at 1280 px
    (measured by test_page; pages it did not measure are opened here)."""
    for name in PAGES:
        if name not in SCROLLING:
            page, _ = open_page(browser, site, f"{name}.html")
            expand_everything(page)
            measure_scrolling(page, name)
            page.context.close()
    blocks = sum(n_code + n_out for n_code, n_out, *_ in SCROLLING.values())
    scrolling = sum(s_code + s_out for _, _, s_code, s_out, _ in SCROLLING.values())
    report = [f"{name}: {s_code} of {n_code} code cells, {s_out} of {n_out} outputs\n      " + "\n      ".join(lines)
              for name, (n_code, n_out, s_code, s_out, lines) in SCROLLING.items() if s_code or s_out]
    assert blocks and scrolling < MAX_SCROLLING_FRACTION * blocks, (
        f"{scrolling} of {blocks} code cells and outputs ({scrolling / blocks:.1%}) scroll sideways at 1280 px "
        f"(at most {MAX_SCROLLING_FRACTION:.0%}):\n  " + "\n  ".join(report))


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
    width = page.evaluate(f"() => document.querySelector('img[src=\"{fourth}\"]').getBoundingClientRect().width")
    assert width >= 500, f"the heatmap is {width} px wide at 1280 px"
    assert explorer.get_by_text("needs a running Python kernel").is_visible(), "nothing says a new text needs a kernel"
    page.context.close()
    assert not problems, problems


def test_attention_explorer_on_a_phone(browser, site, screenshots):
    """At 390 px: the heatmap fits the column with tick labels of at least 9 px, the sliders'
    tracks are wide enough to drag, and the page is no wider than the screen."""
    from attnlib.book import style

    page, problems = open_page(browser, site, "notebooks/12_gpt.html", viewport=PHONE, touch=True)
    page.wait_for_selector(".jupyter-widgets img", state="visible", timeout=60_000)
    explorer = page.locator(".widget-vbox").filter(has=page.locator("img")).first
    explorer.scroll_into_view_if_needed()
    (screenshots / "phone").mkdir(exist_ok=True)
    explorer.screenshot(path=str(screenshots / "phone" / "explorer.png"))
    heatmap = page.evaluate(
        f"() => {{ const r = document.querySelector('img[src=\"{visible_heatmap(page)}\"]').getBoundingClientRect();"
        " return [r.left, r.right, r.width]; }")
    left, right, width = heatmap
    assert left >= 0 and right <= PHONE["width"], f"the heatmap spans {left:.0f} to {right:.0f} px"
    tick_px = style.MIN_FONT_PT * 100 / 72 * width / (style.WIDTH * 100)  # drawn for 560 px, shown at `width`
    assert tick_px >= 9, f"tick labels are {tick_px:.1f} px on a {PHONE['width']} px phone"
    tracks = explorer.locator(".widget-slider .slider-container").evaluate_all(
        "els => els.map(e => e.getBoundingClientRect().width)")
    assert len(tracks) == 2 and min(tracks) >= 150, f"slider tracks {tracks} px wide"
    outside = explorer.evaluate(
        """box => { const b = box.getBoundingClientRect();
             return [...box.querySelectorAll('.jupyter-widgets, select, img')].filter(e => e.offsetParent !== null)
               .map(e => [e.className || e.tagName, e.getBoundingClientRect()])
               .filter(([_, r]) => r.left < b.left - 0.5 || r.right > b.right + 0.5)
               .map(([c, r]) => `${String(c).slice(0, 50)}: ${r.left.toFixed(1)} to ${r.right.toFixed(1)} px`); }""")
    box = explorer.evaluate("box => { const b = box.getBoundingClientRect(); return [b.left, b.right]; }")
    assert not outside, f"controls stick out of the explorer's box {box}: {outside}"
    explorer.locator(".noUi-handle").first.press("ArrowRight")  # still switches heatmaps
    assert page.evaluate("() => document.documentElement.scrollWidth") <= PHONE["width"] + 1
    page.context.close()
    assert not problems, problems
