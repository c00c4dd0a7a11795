"""Issue 38 in Chromium: the cluster widget (`ClusterLauncher`, `gpulab.cluster`'s fields)
holds a cluster for the notebook's kernel. The machine's one GPU is busy with a job of the
person's, so the widget shows the cluster waiting in line with its place; when the job is
stopped, the cluster starts and the widget says its servers are serving; a cell trains on
it (this kernel is the coordinator) and TensorBoard's own magic shows the run inline; Stop
ends it and its GPU comes back. With ``GPULAB_SCREENSHOTS=docs/images`` it takes the README's
picture of it (``cluster.png``)."""

import re

import pytest

from tests.app.hubctl import Browser
from tests.app.test_jobs_api import SLEEPER, mw, wait_state
from tests.conftest import PASSWORD, hub_with_config
from tests.e2e.notebook import run_cell, wait_for_kernel

from .test_lab_browser import login
from .test_newcomer_browser import shot

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    yield from hub_with_config(workdir, prefix, "", gpus=1)


@pytest.fixture(scope="module")
def hal(hub):
    admin = Browser(hub, "admin")
    admin.login(hub.admin_password)
    b = Browser(hub, "hal")
    assert b.signup(PASSWORD).status_code == 200
    assert admin.approve("hal").status_code == 200
    b.login(PASSWORD)
    r = b.start_server("", {"profile": "cpu"})  # (the GPU stays free for the job)
    assert r.status_code in (201, 202), r.text
    return b


def test_the_widget_holds_a_cluster_that_waits_in_line_then_serves(page, hub, hal):
    r = hal.service("POST", "jobs", json=mw("busy", workers=1, gpus=1, source=SLEEPER))
    assert r.status_code == 201, r.text
    wait_state(hal, "busy", ("Running",))

    login(page, hub, "hal", PASSWORD)
    page.wait_for_url(re.compile(r".*/user/hal/lab.*"), timeout=90_000)
    page.locator(".jp-LauncherCard[data-category='Notebook']").first.click(timeout=60_000)
    wait_for_kernel(page)
    run_cell(page, "from gpulab.extensions import ClusterLauncher\n"
                   "w = ClusterLauncher(name='e2e-held', workers=1, gpus_per_worker=1)\nw", 0)
    widget = page.locator(".jp-OutputArea .gpulab-cluster-launcher").first
    widget.wait_for(timeout=120_000)
    assert widget.locator(".gpulab-cluster-workers input").input_value() == "1"
    widget.locator("button.gpulab-hold").click()

    # waiting: its place in line, in the widget
    status = widget.locator(".gpulab-cluster-status")
    status.locator("[data-state='Queued']").wait_for(timeout=60_000)
    assert "in line" in status.inner_text(), status.inner_text()
    view = hal.service("GET", "jobs/e2e-held").json()
    assert (view["kind"], view["state"]) == ("cluster", "Queued"), view

    # the GPU comes back: the cluster starts, and the widget says it serves
    assert hal.service("POST", "jobs/busy/stop").status_code == 200
    status.locator("[data-state='Serving']").wait_for(timeout=180_000)
    assert "1 ps and 1 workers serving" in status.inner_text(), status.inner_text()
    held = hal.service("GET", "me").json()["holdings"]
    assert [(h["name"], h["gpus"]) for h in held] == [("e2e-held", 1)], held

    # a cell trains on it: this kernel is the coordinator
    run_cell(page, "import tensorflow as tf\n"
                   "strategy = w.cluster.strategy()\n"
                   "with strategy.scope():\n"
                   "    v = tf.Variable(0.0)\n"
                   "coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)\n"
                   "step = tf.function(lambda: v.assign_add(1.0))\n"
                   "for _ in range(5):\n"
                   "    coordinator.schedule(step)\n"
                   "coordinator.join()\n"
                   "print('trained', v.numpy())", 1, paste=True)
    page.locator(".jp-OutputArea-output", has_text="trained 5.0").wait_for(timeout=180_000)

    # TensorBoard inline for the run: the coordinator (this kernel) writes the run's summaries
    # to the person's folder, and TensorBoard's own magic shows them in the notebook
    run_cell(page, "import os\n"
                   "logdir = os.path.join(os.environ.get('GPULAB_USER_DIR') or "
                   "os.path.expanduser('~'), 'e2e-held-logs')\n"
                   "with tf.summary.create_file_writer(logdir).as_default():\n"
                   "    for i in range(5):\n"
                   "        coordinator.schedule(step)\n"
                   "        coordinator.join()\n"
                   "        tf.summary.scalar('cluster_loss', 1.0 / float(v.numpy()), step=i)\n"
                   "%load_ext tensorboard\n"
                   "%tensorboard --logdir $logdir", 2, paste=True)
    board = page.frame_locator(".jp-OutputArea-output iframe").last
    board.get_by_text(re.compile("cluster_loss")).first.wait_for(timeout=180_000)
    shot(page, "cluster.png")

    widget.locator("button.gpulab-cluster-stop").click()
    status.locator("[data-state='Stopped']").wait_for(timeout=60_000)
    assert hal.service("GET", "me").json()["holdings"] == []
