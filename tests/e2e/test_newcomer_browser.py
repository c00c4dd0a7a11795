"""What the README tells a newcomer, done in Chromium against a fresh `gpulab up` with its
defaults (4 simulated GPUs, no quota) plus the set-up the issue names as normal (a 2-GPU
default quota): the admin logs in with the generated password, goes to the admin page by
"GPU admin" in the hub's navigation and sets the quota there (the "Effective quota" column
and the audit trail follow the save in place, with no reload); a newcomer signs up, is
refused until approved, is approved by the admin on the authorization page, logs in, starts
the default 1-GPU server; in JupyterLab 4 the examples are in their folder (their own copy)
and the launcher's card "Train a model" opens the ready notebook among them, whose launcher
(the README's own, read from README.md) runs the example file chosen from the folder, and
the README's magic example runs too, both to Succeeded with real TensorFlow; TensorBoard shows their runs; a program that
raises shows its traceback in the JobView; a job is stopped from its JobView; Keras' progress
bar (`Model.fit`, default verbose) is one clean line per epoch in the JobView, and a worker
killed mid-epoch shows its restart (which, when, why) and a line in its log; a job that
waits for the newcomer's quota shows its place, its estimated start (from the time limit of
the job holding the quota) and why, and starts when that job is stopped; the jobs list
renders in Notebook 7; the admin page shows the newcomer's holdings with device numbers and
how busy they are. Another person cannot open the newcomer's TensorBoard.

With ``GPULAB_SCREENSHOTS=<folder>`` the pictures of docs/images/ are saved there (the
README's pictures come from this test: ``GPULAB_SCREENSHOTS=docs/images``).
"""

import os
import re
import time
from pathlib import Path

import pytest
import requests

from tests.app.hubctl import Browser
from tests.conftest import PASSWORD
from tests.e2e.notebook import run, run_cell, type_into, wait_for_kernel

pytestmark = [pytest.mark.e2e, pytest.mark.tf]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits_parameter_server.py"
READY = "Train a model.ipynb"  # the ready notebook in examples/
SHOTS = os.environ.get("GPULAB_SCREENSHOTS")
NEWCOMER = "newton"


def readme_examples() -> tuple[str, str]:
    """The README's launcher call and its magic line, as a newcomer would copy them."""
    text = (ROOT / "README.md").read_text()
    launcher = re.search(r"^(TrainingLauncher\([^)]*\))", text, re.M)
    magic = re.search(r"^(%%gpulab_train [^\n]*)$", text, re.M)
    assert launcher and magic, "the README lost its launcher or magic example"
    return launcher.group(1), magic.group(1)


# a Keras `Model.fit` with the default verbose (a bar redrawn with \b and \r every step)
# whose worker is killed once mid-epoch (SIGKILL): it restarts, and trains to the end
KERAS_JOB = """%%gpulab_train --name keras-bar --strategy multi-worker-mirrored --workers 1
import os, signal, time
import numpy as np
import tensorflow as tf

x = np.random.rand(256, 8).astype("float32")
y = (x.sum(axis=1) > 4).astype("int32")
model = tf.keras.Sequential([tf.keras.layers.Dense(2, activation="softmax")])
model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])


class SlowAndKilledOnce(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.05)
        if batch == 8 and not os.path.exists("killed-once"):
            open("killed-once", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


model.fit(x, y, epochs=2, batch_size=16, callbacks=[SlowAndKilledOnce()])"""

# whether the last characters of a log box's text lie inside the box's visible area
NEWEST_LINE_VISIBLE = """box => {
    const text = box.querySelector('pre').firstChild;
    const end = text.textContent.trimEnd().length;
    const range = document.createRange();
    range.setStart(text, Math.max(0, end - 3));
    range.setEnd(text, end);
    const r = range.getBoundingClientRect(), b = box.getBoundingClientRect();
    return box.scrollHeight > box.clientHeight && r.top >= b.top - 1 && r.bottom <= b.bottom + 1;
}"""


def shot(page, name, locator=None):
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        (locator or page).screenshot(path=str(Path(SHOTS) / name))


def login(page, hub, name, password):
    page.goto(hub.url + "/hub/login")
    page.fill("input[name=username]", name)
    page.fill("input[name=password]", password)
    page.click("input[type=submit], button[type=submit]")


def logout(page, hub):
    page.goto(hub.url + "/hub/logout")
    page.wait_for_url(re.compile(r".*/hub/login.*"))


def state_of(view):
    return view.locator(".gpulab-job-state .gpulab-state").first


def wait_state(page, view, state, timeout):
    state_of(view).and_(page.locator(f"[data-state='{state}']")).wait_for(timeout=timeout)


def test_the_readme_path_from_sign_up_to_trained_jobs(page, hub):
    launcher_call, magic_line = readme_examples()

    # -- the admin: the generated password from its file, then a 2-GPU default quota ---------
    admin_password = (hub.data_dir / "admin_password").read_text().strip()
    login(page, hub, "admin", admin_password)
    page.wait_for_url(re.compile(r".*/hub/.*"))
    page.goto(hub.url + "/hub/home")
    page.click("nav #gpulab-admin-nav")  # "GPU admin" in the hub's own navigation
    page.wait_for_url(re.compile(r".*/services/gpulab/admin"))
    page.evaluate("window.gpulabNoReload = true")  # gone if the page reloaded
    default = page.locator("form.quota[data-kind='default']")
    default.locator("input[name=max_gpus]").fill("2")
    default.locator("button[name=save]").click()
    default.locator(".msg.ok").wait_for()
    # the save shows at once: the admin's effective quota is the new default, and the audit
    # trail's newest line says so, without a reload
    assert page.locator("tr[data-user='admin'] td.effective").inner_text().startswith(
        "2 GPUs at once")
    newest = page.locator("#audit tbody tr").first
    assert "default" in newest.inner_text()
    assert newest.locator("td.new").inner_text() == "2 GPUs at once"
    assert page.evaluate("window.gpulabNoReload") is True
    logout(page, hub)

    # -- the newcomer signs up; not approved yet, the login is refused ----------------------
    page.goto(hub.url + "/hub/signup")
    page.fill("input[name=username]", NEWCOMER)
    page.fill("input[name=signup_password]", PASSWORD)
    page.fill("input[name=signup_password_confirmation]", PASSWORD)
    page.click("#signup_submit")
    page.get_by_text(re.compile("information has been sent to the admin|authoriz", re.I)).first \
        .wait_for()
    login(page, hub, NEWCOMER, PASSWORD)
    page.get_by_text(re.compile("has not been authorized by an administrator", re.I)).first.wait_for()
    assert "/user/" not in page.url

    # -- the admin approves on the authorization page --------------------------------------
    login(page, hub, "admin", admin_password)
    page.wait_for_url(re.compile(r".*/hub/.*"))
    page.goto(hub.url + "/hub/authorize")
    # the buttons are forms that POST with the hub's XSRF token (issue 33.4)
    page.locator(f"form[action$='authorize/{NEWCOMER}'] button", has_text="Authorize").click()
    page.locator(f"form[action$='authorize/{NEWCOMER}'] button", has_text="Unauthorize").wait_for()
    logout(page, hub)

    # -- the newcomer logs in and starts the default server (1 GPU) ------------------------
    login(page, hub, NEWCOMER, PASSWORD)
    page.wait_for_url(re.compile(r".*/hub/spawn.*"))
    assert page.locator("#profile-gpu-1").is_checked()  # the default profile
    assert "2 GPUs at once" in page.locator(".gpulab-quota").first.inner_text()
    shot(page, "spawn.png")
    page.click("form#spawn_form input[type=submit], form#spawn_form button[type=submit]")
    page.wait_for_url(re.compile(rf".*/user/{NEWCOMER}/lab.*"), timeout=120_000)

    # -- the examples are in the newcomer's folder, their own copy, as the README says -------
    user_dir = hub.data_dir / "shared" / "users" / NEWCOMER
    page.locator(".jp-DirListing-itemText", has_text=re.compile(r"^examples$")).wait_for(
        timeout=60_000)
    copy = user_dir / "examples"
    assert (copy / EXAMPLE.name).read_text() == EXAMPLE.read_text()
    assert os.stat(copy / EXAMPLE.name).st_uid == os.stat(user_dir).st_uid  # theirs
    page.locator(".jp-LauncherCard[title*='TensorBoard'], .jp-LauncherCard:has-text('TensorBoard')"
                 ).first.wait_for(timeout=60_000)
    card = page.locator(".jp-LauncherCard", has_text="Train a model")
    card.wait_for(timeout=60_000)
    assert page.get_by_text("Would you like to get notified").count() == 0
    shot(page, "launcher.png")

    # -- the card opens the ready notebook; its launcher is the README's, with a file --------
    card.click()
    page.locator(".lm-TabBar-tab", has_text=READY).first.wait_for(timeout=60_000)
    wait_for_kernel(page)
    ready = page.locator(".jp-Notebook .jp-Cell").filter(has_text="TrainingLauncher(").first
    assert launcher_call.rstrip(")") in ready.locator(".cm-content").inner_text()
    started = time.monotonic()
    run(page, ready)
    launcher = ready.locator(".gpulab-launcher")
    launcher.wait_for(timeout=120_000)
    # (issue 37: it took about 30 s with no sign of life; now the form comes first and reads
    # the quota behind it: tests/unit/test_widgets.py)
    print(f"the launcher appeared {time.monotonic() - started:.1f} s after the cell ran")
    launcher.locator(".gpulab-quota").filter(has_text="2 GPUs at once").wait_for(timeout=60_000)
    button = launcher.locator("button.gpulab-launch-button")
    # a .py file of the person's folder: the example, in their examples/
    launcher.locator(".gpulab-code-source button", has_text="a file").click()
    launcher.locator(".gpulab-file select").select_option(label="examples/" + EXAMPLE.name)
    page.wait_for_function("b => !b.disabled", arg=button.element_handle(), timeout=10_000)
    launcher.scroll_into_view_if_needed()
    shot(page, "train-a-model.png", launcher)
    # bad input is flagged before anything is submitted
    workers = launcher.locator(".gpulab-workers input")
    kept = workers.input_value()
    workers.fill("0")
    workers.press("Enter")
    page.wait_for_function("b => b.disabled", arg=button.element_handle(), timeout=10_000)
    assert "worker" in launcher.locator(".gpulab-launch-reason").inner_text().lower()
    workers.fill(kept)
    workers.press("Enter")
    page.wait_for_function("b => !b.disabled", arg=button.element_handle(), timeout=10_000)
    button.click()

    view = ready.locator(".gpulab-jobview").first
    view.wait_for(timeout=60_000)
    wait_state(page, view, "Running", 240_000)
    view.locator(".gpulab-progress-text").filter(has_text=re.compile(r"\d")).wait_for(
        timeout=240_000)
    shot(page, "job-running.png", view)
    wait_state(page, view, "Succeeded", 300_000)
    assert view.locator(".gpulab-replica[data-state='Running']").count() == 0
    first_job = view.locator("b", has_text=re.compile(r"^Job ")).first.inner_text().split()[1]

    # TensorBoard in the cell output shows the job's loss curve
    view.locator(".gpulab-tensorboard-toggle").first.click()
    frame = view.frame_locator("iframe.gpulab-tensorboard-frame")
    frame.get_by_text(re.compile("epoch_loss")).first.wait_for(timeout=120_000)
    board = view.locator(".gpulab-tensorboard")
    board.scroll_into_view_if_needed()
    shot(page, "tensorboard.png", board)

    # -- a notebook of their own (the launcher's Python card) ---------------------------------
    page.keyboard.press("Control+Shift+L")  # a new launcher
    page.locator(".jp-LauncherCard[data-category='Notebook']").first.click(timeout=60_000)
    page.locator(".lm-TabBar-tab", has_text="Untitled").first.wait_for(timeout=60_000)
    wait_for_kernel(page)

    # -- the README's magic example, as written, with the example as the cell's code --------
    run_cell(page, "%load_ext gpulab", 0)
    magic = run_cell(page, magic_line + "\n" + EXAMPLE.read_text().rstrip("\n"), 1, paste=True)
    second = magic.locator(".gpulab-jobview").first
    second.wait_for(timeout=60_000)
    wait_state(page, second, "Succeeded", 300_000)
    magic_job = re.search(r"--name (\S+)", magic_line).group(1)

    # -- a program that raises: its traceback is where the person looks ---------------------
    broken = run_cell(page, "%%gpulab_train --name broken --strategy multi-worker-mirrored "
                            "--workers 1\nimport json\n\nraise ValueError('bad learning rate')", 2)
    failed = broken.locator(".gpulab-jobview").first
    failed.wait_for(timeout=60_000)
    wait_state(page, failed, "Failed", 240_000)
    assert "ValueError: bad learning rate" in state_of(failed).inner_text()
    failed.locator(".gpulab-log").filter(has_text="Traceback").first.wait_for(timeout=60_000)
    assert "raise ValueError('bad learning rate')" in failed.locator(".gpulab-log").inner_text()
    # the log box shows its newest lines (the traceback's end), not its first
    assert failed.locator(".gpulab-log-scroll").evaluate(NEWEST_LINE_VISIBLE)
    assert failed.locator("button.gpulab-stop").is_hidden()  # nothing left to stop
    shot(page, "job-failed.png", failed)

    # -- a job stopped from its JobView gives its GPU back -----------------------------------
    sleeper = run_cell(page, "%%gpulab_train --name sleeper --strategy multi-worker-mirrored "
                             "--workers 1 --gpus 1\nimport time\ntime.sleep(600)", 3)
    sv = sleeper.locator(".gpulab-jobview").first
    sv.wait_for(timeout=60_000)
    wait_state(page, sv, "Running", 240_000)
    sv.locator("button.gpulab-stop").click()
    sv.locator("button.gpulab-stop-confirm").click()
    wait_state(page, sv, "Stopped", 60_000)

    # -- Keras' own progress bar (Model.fit, default verbose) is one clean line, and a killed
    # worker's restart says which, when and why (issue 34) ------------------------------------
    keras = run_cell(page, KERAS_JOB, 4, paste=True)
    kv = keras.locator(".gpulab-jobview").first
    kv.wait_for(timeout=60_000)
    wait_state(page, kv, "Succeeded", 300_000)
    restarts = kv.locator(".gpulab-restarts")
    restarts.filter(has_text="killed by SIGKILL (exit -9)").wait_for(timeout=30_000)
    assert re.search(r"worker-0: restart 1 at \d\d:\d\d:\d\d \(attempt 2\): killed by "
                     r"SIGKILL \(exit -9\)", restarts.inner_text()), restarts.inner_text()
    box = kv.locator(".gpulab-log")
    # the last epoch's bar in its final state (the log streams on after the job's state: a
    # wait for "Epoch 2/2" alone read it while the bar still said 14/16)
    box.filter(has_text=re.compile(r"Epoch 2/2\s*16/16 \[=+\] - \d+s")).wait_for(
        timeout=60_000)
    log = box.inner_text()
    assert re.search(r"^--- restart 1 of worker 0 at \d\d:\d\d:\d\d: previous attempt killed by "
                     r"SIGKILL \(exit -9\) ---$", log, re.M), log
    # after the restart, each epoch's bar once, in its last state: no redraws, no control
    # characters or colour codes
    after = log.split("--- restart 1 of worker 0")[1].splitlines()
    ends = [ln for ln in after if re.match(r"16/16 \[=+\] - \d+s \d+ms/step - loss", ln)]
    assert len(ends) == 2 and [ln for ln in after if ln.startswith("Epoch ")] == [
        "Epoch 1/2", "Epoch 2/2"], log
    assert not [ln for ln in after if ln.count("/16 [") > 1], log
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]|\[0m|\x1b", log), repr(log)
    kv.scroll_into_view_if_needed()
    shot(page, "job-keras.png", kv)

    # -- a job that waits says its place, when it starts and why (issue 37): the notebook and
    # a job with a time limit use the newcomer's 2 GPUs; the next job queues, then starts
    # when that job is stopped ---------------------------------------------------------------
    holder = run_cell(page, "%%gpulab_train --name holder --strategy multi-worker-mirrored "
                            "--workers 1 --gpus 1 --max-runtime 900\nimport time\n"
                            "time.sleep(600)", 5)
    hv = holder.locator(".gpulab-jobview").first
    hv.wait_for(timeout=60_000)
    wait_state(page, hv, "Running", 240_000)
    waiting = run_cell(page, "%%gpulab_train --name next-in-line --strategy "
                             "multi-worker-mirrored --workers 1 --gpus 1\nprint('my turn')", 6)
    qv = waiting.locator(".gpulab-jobview").first
    qv.wait_for(timeout=60_000)
    wait_state(page, qv, "Queued", 60_000)
    # from the holder's time limit: it ends by its start plus 900 s
    state_of(qv).filter(has_text=re.compile(
        r"Queued · next in line · starts in about 1[45] min \(\d\d:\d\d\)")).wait_for(
        timeout=30_000)
    qv.locator(".gpulab-queue-reason").filter(has_text=re.compile(
        r"^Waits for your quota: .*your job 'holder' \(1 GPU, its time limit ends in about "
        r"1[45] min\)")).wait_for(timeout=30_000)
    qv.scroll_into_view_if_needed()
    shot(page, "job-queued.png", qv)
    hv.locator("button.gpulab-stop").click()
    hv.locator("button.gpulab-stop-confirm").click()
    wait_state(page, hv, "Stopped", 60_000)
    wait_state(page, qv, "Succeeded", 240_000)
    assert qv.locator(".gpulab-queue-reason").count() == 0  # it no longer waits

    # -- TensorBoard of the server shows both trained jobs' runs -----------------------------
    page.keyboard.press("Control+s")
    page.wait_for_timeout(1000)
    tb = page.context.new_page()
    try:
        tb.goto(hub.user_url(NEWCOMER) + "tensorboard/#timeseries")
        for job in (first_job, magic_job):
            tb.get_by_text(re.compile(re.escape(job))).first.wait_for(timeout=120_000)
        # another person cannot open it
        bob = Browser(hub, "bob")
        assert bob.signup(PASSWORD).status_code == 200
        # (from Python, whose requests know *.localhost: tests/app/hubctl.py)
        r = requests.get(hub.user_url(NEWCOMER) + "tensorboard/", headers={
            "Authorization": "token " + _approved_token(hub, admin_password, bob)},
            allow_redirects=False, timeout=30)
        assert r.status_code == 403
    finally:
        tb.close()

    # -- Notebook 7 renders the widgets too: the jobs list with the jobs -------------------
    page.goto(hub.user_url(NEWCOMER) + "notebooks/Untitled.ipynb")
    page.locator(".jp-Notebook").first.wait_for(timeout=120_000)
    cells = page.locator(".jp-Notebook .jp-Cell")
    cells.last.locator(".cm-content").click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # a new cell below
    type_into(page, cells.last, "from gpulab.extensions import JobsList\nJobsList()")
    run(page, cells.last)
    rows = page.locator(".gpulab-jobslist .gpulab-job-row")
    rows.filter(has_text=magic_job).first.wait_for(timeout=120_000)
    assert rows.filter(has_text="broken").count() >= 1

    # -- the admin page: the newcomer's server, which GPU, and how busy it is -----------------
    logout(page, hub)
    login(page, hub, "admin", admin_password)
    page.wait_for_url(re.compile(r".*/hub/.*"))
    page.goto(hub.service_url + "admin")
    held = page.locator(f"tr[data-user='{NEWCOMER}'] td.held").inner_text()
    assert re.search(r"notebook 'default' \(1\): GPU \d", held), held
    assert "simulated (nothing to measure)" in held
    shot(page, "admin.png")


def _approved_token(hub, admin_password, person: Browser) -> str:
    """Approve `person` (as the admin, over HTTP), log them in, and return a token of theirs."""
    admin = Browser(hub, "admin")
    admin.login(admin_password)
    assert admin.approve(person.name).status_code == 200
    person.login(PASSWORD)
    return person.token()
