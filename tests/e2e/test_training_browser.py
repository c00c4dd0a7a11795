"""A researcher in a browser trains from a notebook: JupyterLab 4 with gpulab's widgets, the
parameter-server digits example launched from `TrainingLauncher`, watched live to Succeeded,
TensorBoard inline; a second job from the `%%gpulab_train` magic, stopped from its JobView;
the jobs list in Notebook 7. Against `gpulab up` (the `hub` fixture), with real TensorFlow.

With ``GPULAB_SCREENSHOTS=<folder>`` the launcher, the running job and TensorBoard are saved
there (the README's pictures in docs/images/ come from this test).
"""

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import PASSWORD
from tests.e2e.notebook import run, run_cell, type_into, wait_for_kernel

pytestmark = [pytest.mark.e2e, pytest.mark.tf]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits_parameter_server.py"
SHOTS = os.environ.get("GPULAB_SCREENSHOTS")


def shot(page, name, locator=None):
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        (locator or page).screenshot(path=str(Path(SHOTS) / name))


def login(page, hub, name):
    page.goto(hub.url + "/hub/login")
    page.fill("input[name=username]", name)
    page.fill("input[name=password]", PASSWORD)
    page.click("input[type=submit], button[type=submit]")


def state_of(view):
    return view.locator(".gpulab-job-state .gpulab-state").first


def test_train_from_a_notebook_watch_it_and_see_tensorboard(page, hub, users):
    user_dir = hub.data_dir / "shared" / "users" / "ann"
    login(page, hub, "ann")
    page.wait_for_url(re.compile(r".*/hub/spawn.*"))
    page.check("#profile-gpu-1")
    page.click("form#spawn_form input[type=submit], form#spawn_form button[type=submit]")
    page.wait_for_url(re.compile(r".*/user/ann/lab.*"), timeout=120_000)

    # the example, in the person's own folder (as if uploaded), owned by their account
    shutil.copy(EXAMPLE, user_dir / EXAMPLE.name)
    st = os.stat(user_dir)
    os.chown(user_dir / EXAMPLE.name, st.st_uid, st.st_gid)

    # TensorBoard has a card in the launcher
    page.locator(".jp-LauncherCard[title*='TensorBoard'], .jp-LauncherCard:has-text('TensorBoard')"
                 ).first.wait_for(timeout=60_000)
    # gpulab's lab settings: nobody is asked about Jupyter's news feed
    assert page.get_by_text("Would you like to get notified").count() == 0
    shot(page, "launcher.png")

    page.locator(".jp-LauncherCard[data-category='Notebook']").first.click(timeout=60_000)
    wait_for_kernel(page)
    out = run_cell(page, "from gpulab.extensions import TrainingLauncher\n"
                         "TrainingLauncher(name='digits-nb', ps=1, workers=2, gpus=1)", 0)
    launcher = out.locator(".gpulab-launcher")
    launcher.wait_for(timeout=120_000)
    assert "GPU" in launcher.locator(".gpulab-quota").inner_text()

    # bad input is flagged before anything is submitted
    workers = launcher.locator(".gpulab-workers input")
    workers.fill("0")
    workers.press("Enter")
    button = launcher.locator("button.gpulab-launch-button")
    page.wait_for_function("b => b.disabled", arg=button.element_handle(), timeout=10_000)
    assert "worker" in launcher.locator(".gpulab-launch-reason").inner_text().lower()
    workers.fill("2")
    workers.press("Enter")

    launcher.locator(".gpulab-code-source button", has_text="a file").click()
    launcher.locator(".gpulab-file select").select_option(label=EXAMPLE.name)
    page.wait_for_function("b => !b.disabled", arg=button.element_handle(), timeout=10_000)
    button.click()

    view = out.locator(".gpulab-jobview").first
    view.wait_for(timeout=60_000)
    state_of(view).and_(page.locator("[data-state='Running']")).wait_for(timeout=240_000)
    view.locator(".gpulab-replica[data-replica='worker-1']").wait_for(timeout=30_000)
    view.locator(".gpulab-progress-text").filter(has_text=re.compile(r"\d")).wait_for(
        timeout=240_000)
    shot(page, "job-running.png", view)
    state_of(view).and_(page.locator("[data-state='Succeeded']")).wait_for(timeout=300_000)
    assert view.locator(".gpulab-replica[data-state='Running']").count() == 0

    # TensorBoard in the cell output shows the job's loss curve
    view.locator(".gpulab-tensorboard-toggle").first.click()
    frame = view.frame_locator("iframe.gpulab-tensorboard-frame")
    frame.get_by_text(re.compile("epoch_loss")).first.wait_for(timeout=120_000)
    board = view.locator(".gpulab-tensorboard")
    board.scroll_into_view_if_needed()
    shot(page, "tensorboard.png", board)

    # the same through the cell magic, then stopped from its JobView
    run_cell(page, "%load_ext gpulab", 1)
    magic = run_cell(page, "%%gpulab_train --name sleeper --strategy multi-worker-mirrored "
                           "--workers 1 --gpus 1\nimport time\ntime.sleep(600)", 2)
    second = magic.locator(".gpulab-jobview").first
    second.wait_for(timeout=60_000)
    state_of(second).and_(page.locator("[data-state='Running']")).wait_for(timeout=240_000)
    second.locator("button.gpulab-stop").click()
    second.locator("button.gpulab-stop-confirm").click()
    state_of(second).and_(page.locator("[data-state='Stopped']")).wait_for(timeout=60_000)
    assert second.locator(".gpulab-replica[data-state='Running']").count() == 0
    me = users["ann"].service("GET", "me").json()
    assert [h["kind"] for h in me["holdings"]] == ["notebook"], me["holdings"]

    # another person cannot open ann's TensorBoard
    bob_page = page.context.new_page()
    try:
        r = bob_page.request.get(hub.url + "/user/ann/tensorboard/", headers={
            "Authorization": f"token {users['bob'].token()}"}, max_redirects=0)
        assert r.status == 403
    finally:
        bob_page.close()

    # Notebook 7 renders the widgets too: the jobs list with both jobs
    page.keyboard.press("Control+s")
    page.wait_for_timeout(1000)
    page.goto(hub.url + "/user/ann/notebooks/Untitled.ipynb")
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                 ".jp-Notebook").first.wait_for(timeout=120_000)
    cells = page.locator(".jp-Notebook .jp-Cell")
    cells.last.locator(".cm-content").click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # a new cell below
    type_into(page, cells.last, "from gpulab.extensions import JobsList\nJobsList()")
    run(page, cells.last)
    rows = page.locator(".gpulab-jobslist .gpulab-job-row")
    rows.filter(has_text="digits-nb").first.wait_for(timeout=120_000)
    assert rows.filter(has_text="sleeper").count() >= 1
