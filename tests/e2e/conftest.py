"""A real browser (Debian's Chromium, driven by Playwright) against `gpulab up`."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("GPULAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]


@pytest.fixture(scope="module")
def chromium():
    # one browser per module, not per session: Playwright's sync API keeps its event loop
    # marked as running in this thread while it is open, which breaks every asyncio test
    # (pytest-asyncio) that runs after it
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: install it with `apt-get install chromium` "
                    "(scripts/test.sh does this as root).")
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="gpulab-chromium-")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 900},
        )
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(chromium, request):
    pg = chromium.new_page()
    pg.set_default_timeout(30_000)
    yield pg
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        out = Path(tempfile.gettempdir()) / f"gpulab-e2e-{request.node.name}.png"
        pg.screenshot(path=str(out), full_page=True)
        print(f"screenshot of the failure: {out}")
    pg.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
