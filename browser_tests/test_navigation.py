"""The menu (site navigation) and page-contents buttons, tapped as a reader would.

Each page has two ``.primary-toggle`` buttons (pydata-sphinx-theme's header, hidden by
sphinx-book-theme, and the article header's, the one shown) and both themes bind only the
first; book/_ext/static/book.js forwards the shown button's clicks. On a phone (390 px) the
menu button opens the site navigation and the page-contents button the page's sections, each
with links a reader can tap; on a desktop (1280 px) the menu button hides and shows the
navigation sidebar, and the page's sections are listed beside the text.
"""
from __future__ import annotations

from test_book_pages import DESKTOP, PHONE, open_page

CHAPTER = "notebooks/03_causal_attention.html"
NEXT_CHAPTER = "notebooks/04_multi_head_attention.html"  # a link of the site navigation
NAV_LINK = f"nav.bd-docs-nav a[href$='{NEXT_CHAPTER.split('/')[-1]}']"
PAGE_TOC_LINK = "nav#pst-page-toc-nav a.nav-link[href^='#']"


def shown_button(page, selector: str):
    buttons = page.locator(f"{selector}:visible")
    assert buttons.count() == 1, f"{buttons.count()} visible {selector} buttons"
    return buttons.first


def test_menu_button_on_a_phone(browser, site, screenshots):
    page, problems = open_page(browser, site, CHAPTER, viewport=PHONE, touch=True)
    link = page.locator(NAV_LINK)
    assert not link.is_visible(), "the navigation is shown before the menu button is tapped"
    shown_button(page, ".primary-toggle").tap()
    link.wait_for(state="visible", timeout=5_000)
    page.screenshot(path=str(screenshots / "phone" / "menu.png"))
    link.tap()
    page.wait_for_url(f"**/{NEXT_CHAPTER}", timeout=10_000)
    page.context.close()
    assert not problems, problems


def test_page_contents_button_on_a_phone(browser, site, screenshots):
    page, problems = open_page(browser, site, CHAPTER, viewport=PHONE, dark=True, touch=True)
    links = page.locator(PAGE_TOC_LINK)
    assert not links.first.is_visible(), "the page's contents are shown before the button is tapped"
    shown_button(page, ".secondary-toggle").tap()
    link = links.nth(1)
    link.wait_for(state="visible", timeout=5_000)
    page.screenshot(path=str(screenshots / "phone" / "page-contents.png"))
    anchor = link.get_attribute("href")
    link.tap()
    page.wait_for_function("hash => window.location.hash === hash", arg=anchor, timeout=5_000)
    page.context.close()
    assert not problems, problems


def test_menu_button_on_a_desktop(browser, site, screenshots):
    page, problems = open_page(browser, site, CHAPTER, viewport=DESKTOP, dark=True)
    link = page.locator(NAV_LINK)
    assert link.is_visible(), "no site navigation beside the page at 1280 px"
    assert page.locator(PAGE_TOC_LINK).first.is_visible(), "no page contents beside the page at 1280 px"
    button = shown_button(page, ".primary-toggle")
    button.click()
    link.wait_for(state="hidden", timeout=5_000)
    page.screenshot(path=str(screenshots / "desktop-dark-menu-hidden.png"))
    button.click()
    link.wait_for(state="visible", timeout=5_000)
    link.click()
    page.wait_for_url(f"**/{NEXT_CHAPTER}", timeout=10_000)
    page.context.close()
    assert not problems, problems


SEARCH_CONTROLS = ".search-button__button, .search-button-field, input[type='search']"


def test_one_search_control_on_a_desktop(browser, site):
    """At 1280 px one search control is shown (pydata-sphinx-theme's header bar held a second)."""
    page, problems = open_page(browser, site, CHAPTER, viewport=DESKTOP)
    shown = page.locator(f":is({SEARCH_CONTROLS}):visible")
    assert shown.count() == 1, f"{shown.count()} search controls shown at 1280 px"
    page.context.close()
    assert not problems, problems


SOLUTIONS = "solutions/03_causal_attention_solutions.html"


def solution_shown(page, label: str) -> bool:
    """Whether the body of the solution ``label`` is shown (not collapsed by sphinx-togglebutton)."""
    return page.locator(f"#{label} section, #{label} p:not(.admonition-title)").first.is_visible()


def test_a_solution_link_opens_that_solution(browser, site, screenshots):
    """A chapter's "Solution 03.2" link lands on that solution shown open; the others stay
    collapsed, and following another solution's anchor opens it too."""
    page, problems = open_page(browser, site, CHAPTER)
    link = page.locator("a[href*='03_causal_attention_solutions.html#sol-03-2']").first
    link.scroll_into_view_if_needed()
    link.click()
    page.wait_for_url("**/03_causal_attention_solutions.html#sol-03-2", timeout=10_000)
    page.wait_for_function("() => document.readyState === 'complete'")
    page.locator("#sol-03-2 p:not(.admonition-title)").first.wait_for(state="visible", timeout=5_000)
    assert solution_shown(page, "sol-03-2")
    assert not solution_shown(page, "sol-03-3"), "every solution was opened, not the linked one"
    top = page.evaluate("() => document.getElementById('sol-03-2').getBoundingClientRect().top")
    assert 0 <= top < DESKTOP["height"], f"the linked solution is {top:.0f} px from the top of the window"
    page.screenshot(path=str(screenshots / "solution-link.png"))
    page.evaluate("() => { window.location.hash = '#sol-03-3'; }")
    page.locator("#sol-03-3 p:not(.admonition-title)").first.wait_for(state="visible", timeout=5_000)
    page.context.close()
    assert not problems, problems
