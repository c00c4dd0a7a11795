"""LocalGPUSpawner keeps JupyterHub's base-class contract for ``options_from_form``
(jupyterhub/tests/test_spawner.py, ``test_predefined_options_from_form[default]``): the
default reading passes form fields it does not know through as the base class does (lists of
strings), and the check comes when the server starts (``gpu_selection`` in ``start``), with
a 400 JupyterHub shows on the form. KubeGPUSpawner's side of the same contract (KubeSpawner's
``test_user_options_set_from_form_invalid_regex``) is in test_kube_profile_options.py; a real
spawn with ``shell_cmd`` in tests/app/test_base_contracts.py."""

from types import SimpleNamespace

import pytest
from traitlets.config import Config

from gpulab.hub.machine.inventory import GPUInventory
from gpulab.spawner.local import LocalGPUSpawner
from gpulab.spawner.mixin import GPULedger, OptionRefused


@pytest.fixture
def spawner(tmp_path):
    c = Config()
    c.GPULedger.db_url = f"sqlite:///{tmp_path / 'gpulab.sqlite'}"
    c.GPUInventory.source = "simulated"
    c.GPUInventory.simulated_gpus = 1
    c.LocalGPUSpawner.profile_list = [
        {"display_name": "CPU only", "slug": "cpu", "default": True},
        {"display_name": "1 GPU", "slug": "gpu-1",
         "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"}}}]
    GPULedger.clear_instance()
    GPUInventory.clear_instance()
    yield LocalGPUSpawner(config=c, user=SimpleNamespace(name="ann", id=1, groups=[],
                                                         url="/user/ann/"))
    GPULedger.clear_instance()
    GPUInventory.clear_instance()


def test_the_default_reading_passes_plain_form_data_through(spawner):
    form = {"single": ["value"], "multiple": ["a", "b"], "checkbox": ["on"], "number": ["1"]}
    assert spawner.run_options_from_form(form) == form  # JupyterHub's "unchanged"
    # and the start refuses what gpulab does not know, in words
    with pytest.raises(OptionRefused) as e:
        spawner.gpu_selection(spawner.run_options_from_form(form))
    assert e.value.status_code == 400
    assert "Unknown server option(s): checkbox, multiple, number, single" in str(e.value)


def test_gpulabs_own_fields_are_read_and_others_kept_beside_them(spawner):
    assert spawner.run_options_from_form({"profile": ["gpu-1"], "_xsrf": ["x"]}) == {
        "profile": "gpu-1"}
    options = spawner.run_options_from_form({"profile": ["gpu-1"], "gpus": ["-3"]})
    assert options == {"profile": "gpu-1", "gpus": ["-3"]}
    with pytest.raises(OptionRefused, match=r"Unknown server option\(s\): gpus"):
        spawner.gpu_selection(options)
    for form, message in [({"profile": ["nope"]}, "There is no profile 'nope'"),
                          ({"profile": ["cpu", "gpu-1"]}, "'profile' must be a profile name")]:
        with pytest.raises(OptionRefused, match=message):
            spawner.gpu_selection(spawner.run_options_from_form(form))
    assert spawner.gpu_selection(spawner.run_options_from_form({})).profile.slug == "cpu"
