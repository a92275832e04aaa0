"""Fixtures for the browser tests: the built book served on localhost, and headless Chromium.

The tests read ``_build/html`` (``make book-strict`` or ``make book`` writes it) and drive
Debian's ``chromium`` through Playwright (``executable_path``; Playwright's own browser
downloads are never used). Screenshots go to ``_build/screenshots``.
"""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The built book: _build/html, or another build named by $BOOK_HTML (to compare two builds).
HTML = Path(os.environ.get("BOOK_HTML") or ROOT / "_build" / "html").resolve()
SCREENSHOTS = ROOT / "_build" / "screenshots"

# As for any headless run on a closed network: no sandbox (root in CI), no GPU, and none of
# Chromium's own background traffic (updates, sync, safe browsing), which would be refused anyway.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
]


def chromium_path() -> str:
    """``$CHROMIUM``, else ``chromium`` / ``chromium-browser`` on PATH."""
    found = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        raise RuntimeError("Chromium not found: `make chromium` installs Debian's chromium, or set CHROMIUM=/path/to/it")
    return found


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


@pytest.fixture(scope="session")
def site() -> str:
    """Base URL of ``_build/html`` served by a thread on 127.0.0.1 (a free port)."""
    if not (HTML / "index.html").is_file():
        raise RuntimeError(f"{HTML}/index.html is missing: build the book first (make book-strict)")
    handler = functools.partial(_QuietHandler, directory=str(HTML))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
