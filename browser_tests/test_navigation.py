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
