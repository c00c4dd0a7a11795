"""A person in Chromium on the spawn page of a hub whose profiles offer KubeSpawner's
``profile_options``: a profile over their quota is disabled with the reason in words; they
pick an option inside a GPU profile (its "Other..." text field, shown by the form's script)
and get a server with that option and the profile's GPU."""

import json
import re

import pytest

from tests.app.hubctl import Browser
from tests.conftest import PASSWORD, hub_with_config

from .test_lab_browser import login

pytestmark = pytest.mark.e2e

CONFIG = '''
c.GPULedger.reconcile_interval = 2
c.LocalGPUSpawner.profile_list = [
    {"display_name": "CPU only", "slug": "cpu", "default": True},
    {"display_name": "1 GPU", "slug": "gpu-1",
     "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"}},
     "profile_options": {"env": {
         "display_name": "Environment",
         "choices": {
             "tf": {"display_name": "TensorFlow",
                    "kubespawner_override": {"environment": {"CONDA_DEFAULT_ENV": "tf"}}},
             "torch": {"display_name": "PyTorch",
                       "kubespawner_override": {"environment": {"CONDA_DEFAULT_ENV": "torch"}}}},
         "unlisted_choice": {"enabled": True, "display_name": "Environment name",
                             "validation_regex": "^[a-z]+$",
                             "validation_message": "lower-case letters only",
                             "kubespawner_override": {
                                 "environment": {"CONDA_DEFAULT_ENV": "{value}"}}}}}},
    {"display_name": "2 GPUs", "slug": "gpu-2",
     "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "2"}}},
]
'''

PROBE = ("import os, json\nprint(json.dumps({k: os.environ.get(k) for k in "
         "('CONDA_DEFAULT_ENV', 'CUDA_VISIBLE_DEVICES')}))")


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    yield from hub_with_config(workdir, prefix, CONFIG)


@pytest.fixture(scope="module")
def fay(hub):
    admin = Browser(hub, "admin")
    admin.login(hub.admin_password)
    b = Browser(hub, "fay")
    assert b.signup(PASSWORD).status_code == 200
    assert admin.approve("fay").status_code == 200
    b.login(PASSWORD)
    assert admin.service("PUT", "quotas/users/fay", json={"max_gpus": 1}).status_code == 200
    return b


def test_a_disabled_profile_says_why_and_an_option_reaches_the_server(page, hub, fay):
    login(page, hub, "fay", PASSWORD)
    page.wait_for_url(re.compile(r".*/(hub|user)/.*"))
    page.goto(hub.url + "/hub/spawn")
    form = page.locator("#gpulab-spawn-form")
    # the machine's GPUs in a sentence of their own, the simulated label apart from it
    inventory = form.locator(".gpulab-inventory").inner_text()
    assert "4 of 4 GPUs free on this machine." in inventory, inventory
    assert "machine simulated" not in inventory
    assert form.locator(".gpulab-simulated").inner_text() == "Simulated"

    # over the quota: disabled, with the reason in words
    two = form.locator(".gpulab-profile[data-profile='gpu-2']")
    assert two.locator("input[type=radio]").is_disabled()
    assert ("unavailable: more than your quota allows (1 at once)"
            in " ".join(two.inner_text().split()))

    # an option inside the 1-GPU profile: "Other..." shows its text field
    one = form.locator(".gpulab-profile[data-profile='gpu-1']")
    typed = one.locator("#profile-option-gpu-1--env--unlisted-choice")
    assert not typed.is_visible()
    one.locator("select#profile-option-gpu-1--env").select_option("unlisted-choice")
    assert typed.is_visible() and one.locator("input[type=radio]").is_checked()
    typed.fill("jax")
    page.click("input[type=submit], button[type=submit]")
    page.wait_for_url(re.compile(r".*/user/fay/.*"), timeout=90_000)

    fay.wait_ready("")
    got = json.loads(fay.run_in_kernel(PROBE).strip().splitlines()[-1])
    assert got["CONDA_DEFAULT_ENV"] == "jax"
    assert len(got["CUDA_VISIBLE_DEVICES"].split(",")) == 1
    server = fay.api("GET", "/users/fay").json()["servers"][""]
    # (and the form's "If the GPUs are busy" choice, "don't wait" by default)
    assert server["user_options"] == {"profile": "gpu-1", "env--unlisted-choice": "jax",
                                      "gpu_wait_minutes": 0}

    # the next visit of the form shows the last start's choices
    fay.stop_server("")
    page.goto(hub.url + "/hub/spawn")
    assert one.locator("input[type=radio]").is_checked()
    assert typed.input_value() == "jax" and typed.is_visible()
