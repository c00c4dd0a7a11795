"""TensorBoard's index page as gpulab serves it behind the hub (`relative_fonts`): its Roboto
fonts from where the page is (``/font-roboto/`` is the root of the hub's site: 404), and no
Google Fonts stylesheet (not reachable here). The page itself is TensorBoard's own, read from
its package; the browser test (tests/e2e/test_pages_browser.py) watches the requests."""

import zipfile
from pathlib import Path

import tensorboard

from gpulab.extensions.serverext import relative_fonts


def index_html() -> bytes:
    webfiles = Path(tensorboard.__file__).with_name("webfiles.zip")
    with zipfile.ZipFile(webfiles) as z:
        return z.read("index.html")


def test_fonts_are_relative_and_google_fonts_are_not_asked_for():
    original = index_html()
    assert b"url(/font-roboto/" in original  # what made the fonts 404 behind the hub
    page = relative_fonts(original)
    assert b"url(/font-roboto/" not in page
    assert page.count(b"url(font-roboto/") == original.count(b"url(/font-roboto/")
    flag = page.index(b"window.polymerSkipLoadingFontRoboto = true")
    assert flag < page.index(b'<script src="index.js')  # set before TensorBoard's code runs
    assert page.startswith(b"<!doctype html>")  # still standards mode
    assert relative_fonts(page) == page  # once only
