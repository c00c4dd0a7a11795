"""A person in a browser: log in, pick a GPU profile on the spawn form, land in JupyterLab 4,
open a notebook and see an ipywidgets widget render and react, on the GPU they were given."""

import re

import pytest

from tests.conftest import PASSWORD
from tests.e2e.notebook import run_cell, wait_for_kernel

pytestmark = pytest.mark.e2e


def login(page, hub, name, password):
    page.goto(hub.url + "/hub/login")
    page.fill("input[name=username]", name)
    page.fill("input[name=password]", password)
    page.click("input[type=submit], button[type=submit]")


def test_spawn_form_to_jupyterlab_with_widgets(page, hub, users):
    login(page, hub, "ann", PASSWORD)
    page.wait_for_url(re.compile(r".*/hub/spawn.*"))
    assert page.locator("#gpulab-spawn-form").is_visible()
    assert "4 of 4 GPUs free" in page.inner_text("#gpulab-spawn-form")
    page.check("#profile-gpu-1")
    page.click("form#spawn_form input[type=submit], form#spawn_form button[type=submit]")

    page.wait_for_url(re.compile(r".*/user/ann/lab.*"), timeout=90_000)
    page.locator(".jp-LauncherCard[data-category='Notebook']").first.click(timeout=60_000)
    wait_for_kernel(page)
    code = (
        "import os, ipywidgets as w\n"
        "s = w.IntSlider(value=3, description='gpus')\n"
        "l = w.Label(value='CUDA ' + os.environ['CUDA_VISIBLE_DEVICES'])\n"
        "l.add_class('gpulab-probe')\n"
        "s.observe(lambda ch: setattr(l, 'value', f\"moved to {ch['new']}\"), 'value')\n"
        "w.VBox([s, l])"
    )
    run_cell(page, code, 0)
    slider = page.locator(".jp-OutputArea .widget-slider").first
    error = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    page.locator(".jp-OutputArea .widget-slider, "
                 ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
                 ).first.wait_for(timeout=120_000)
    assert error.count() == 0, error.first.inner_text()
    assert slider.is_visible()
    label = page.locator(".jp-OutputArea .gpulab-probe").first
    assert re.fullmatch(r"CUDA \d", label.inner_text().strip())

    # the widget talks back to the kernel: moving the slider changes the label
    handle = page.locator(".jp-OutputArea .noUi-handle, .jp-OutputArea .ui-slider-handle").first
    handle.focus()
    page.keyboard.press("ArrowRight")
    page.wait_for_function(
        "() => document.querySelector('.jp-OutputArea .gpulab-probe')"
        ".textContent.startsWith('moved to 4')",
        timeout=30_000,
    )
