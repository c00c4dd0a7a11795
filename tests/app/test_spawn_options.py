"""LocalGPUSpawner keeps what LocalProcessSpawner offers an operator, on a real `gpulab up`:
the operator's own ``options_form`` / ``options_from_form`` / ``apply_user_options`` are used
(their fields reach their hook; a ``profile`` among them still chooses the GPU profile), and
KubeSpawner's ``profile_options`` and gpulab's ``allowed_groups`` work through the API.
(The same options from gpulab's own spawn form, in a browser: tests/e2e.)"""

import json

import pytest

from tests.conftest import hub_with_config

from .hubctl import Browser

pytestmark = pytest.mark.app

CONFIG = '''
c.GPULedger.reconcile_interval = 2
c.LocalGPUSpawner.profile_list = [
    {"display_name": "CPU only", "slug": "cpu", "default": True},
    {"display_name": "1 GPU", "slug": "gpu-1",
     "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"},
                              "environment": {"PROFILE": "gpu-1"}},
     "profile_options": {
         "env": {"display_name": "Environment", "choices": {
             "tf": {"display_name": "TensorFlow",
                    "kubespawner_override": {"environment": {"CONDA_DEFAULT_ENV": "tf"}}},
             "torch": {"display_name": "PyTorch",
                       "kubespawner_override": {"environment": {"CONDA_DEFAULT_ENV": "torch"}}}},
             "unlisted_choice": {"enabled": True, "validation_regex": "^[a-z]+$",
                                 "kubespawner_override": {
                                     "environment": {"CONDA_DEFAULT_ENV": "{value}"}}}},
         "size": {"display_name": "GPUs", "choices": {
             "one": {"display_name": "1"},
             "two": {"display_name": "2", "kubespawner_override": {
                 "extra_resource_limits": {"nvidia.com/gpu": "2"}}}}},
         "image": {"display_name": "Image", "choices": {
             "none": {"display_name": "this machine's"},
             "pangeo": {"display_name": "pangeo", "kubespawner_override": {
                 "image": "pangeo/x:1"}}}}}},
    {"display_name": "3 GPUs (ml)", "slug": "gpu-3", "allowed_groups": ["ml"],
     "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "3"}}},
]
c.Spawner.options_form = """
<label>Flavour <select name="flavour"><option>vanilla</option><option>mint</option></select></label>
<label>Profile <select name="profile"><option>cpu</option><option>gpu-1</option></select></label>
"""


def options_from_form(formdata):
    return {"flavour": formdata.get("flavour", ["vanilla"])[0],
            "profile": formdata.get("profile", ["cpu"])[0]}


def apply_user_options(spawner, user_options):
    spawner.environment = {**spawner.environment,
                           "FLAVOUR": str(user_options.get("flavour", "none"))}


c.Spawner.options_from_form = options_from_form
c.Spawner.apply_user_options = apply_user_options
'''

PROBE = ("import os, json\nprint(json.dumps({k: os.environ.get(k) for k in "
         "('FLAVOUR', 'CONDA_DEFAULT_ENV', 'PROFILE', 'CUDA_VISIBLE_DEVICES')}))")


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    yield from hub_with_config(workdir, prefix, CONFIG)


@pytest.fixture(scope="module")
def people(hub):
    from tests.conftest import PASSWORD

    admin = Browser(hub, "admin")
    admin.login(hub.admin_password)
    made = {"admin": admin}
    for name in ("dora", "eli"):
        b = Browser(hub, name)
        assert b.signup(PASSWORD).status_code == 200
        assert admin.approve(name).status_code == 200
        b.login(PASSWORD)
        made[name] = b
    r = admin.api("POST", "/groups/ml", json={"users": ["eli"]})
    assert r.status_code == 201, r.text
    return made


def probe(b, server=""):
    return json.loads(b.run_in_kernel(PROBE, server).strip().splitlines()[-1])


def test_the_operators_form_is_shown_and_its_hooks_get_the_fields(hub, people):
    dora = people["dora"]
    page = dora.s.get(hub.url + "/hub/spawn/dora/own").text
    assert 'name="flavour"' in page and "gpulab-spawn-form" not in page
    r = dora.post_form("/hub/spawn/dora/own", {"flavour": "mint", "profile": "gpu-1"})
    assert r.status_code == 200, r.text[:500]
    dora.wait_ready("own")
    got = probe(dora, "own")
    # the operator's apply_user_options ran; the profile (and its default choices) applied
    assert got["FLAVOUR"] == "mint" and got["PROFILE"] == "gpu-1"
    assert got["CONDA_DEFAULT_ENV"] == "tf"
    assert len(got["CUDA_VISIBLE_DEVICES"].split(",")) == 1
    server = dora.api("GET", "/users/dora").json()["servers"]["own"]
    assert server["user_options"] == {"flavour": "mint", "profile": "gpu-1"}
    dora.stop_server("own")


def test_profile_options_through_the_api_with_the_operators_keys(hub, people):
    dora = people["dora"]
    r = dora.start_server("api", {"profile": "gpu-1", "env--unlisted-choice": "jax",
                                  "size": "two", "flavour": "mint"})
    assert r.status_code in (201, 202), r.text
    got = probe(dora, "api")
    assert (got["FLAVOUR"], got["CONDA_DEFAULT_ENV"]) == ("mint", "jax")
    assert len(got["CUDA_VISIBLE_DEVICES"].split(",")) == 2  # the choice's GPU count
    dora.stop_server("api")
    # a second start of the same server with other options: nothing of the first stays
    r = dora.start_server("api", {"flavour": "vanilla"})
    assert r.status_code in (201, 202), r.text
    got = probe(dora, "api")
    assert got == {"FLAVOUR": "vanilla", "CONDA_DEFAULT_ENV": None, "PROFILE": None,
                   "CUDA_VISIBLE_DEVICES": ""}
    dora.stop_server("api")


@pytest.mark.parametrize("options,status,message", [
    ({"profile": "gpu-1", "env--unlisted-choice": "Not Valid"}, 400, "must match ^[a-z]+$"),
    ({"profile": "gpu-1", "image": "pangeo"}, 400, "only a server on Kubernetes"),
    ({"profile": "gpu-3"}, 400, "There is no profile 'gpu-3'"),
], ids=["regex", "kubernetes-only-choice", "other-groups-profile"])
def test_options_that_cannot_start_are_refused_in_words(people, options, status, message):
    dora = people["dora"]
    r = dora.start_server("bad", options)
    assert r.status_code == status, r.text
    assert message in r.json()["message"]
    assert "bad" not in dora.api("GET", "/users/dora").json()["servers"]


def test_a_groups_profile_starts_for_its_members(people):
    eli = people["eli"]
    r = eli.start_server("", {"profile": "gpu-3"})
    assert r.status_code in (201, 202), r.text
    assert len(probe(eli)["CUDA_VISIBLE_DEVICES"].split(",")) == 3
    eli.stop_server("")
