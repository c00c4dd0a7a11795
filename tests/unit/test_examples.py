"""gpulab's examples where people start (issue 37): the server extension copies them into the
person's folder (`offer_examples`), the ready notebook opens with the launcher card "Train a
model" (a prebuilt JupyterLab extension written by hand), and both are installed with gpulab.
The card in a real JupyterLab, and the copy in a real server, are in
tests/e2e/test_newcomer_browser.py."""

import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest

from gpulab.extensions import serverext
from gpulab.extensions.serverext import installed_examples, offer_examples

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LABEXT = ROOT / "jupyter-config" / "labextension"
NOTEBOOK = "Train a model.ipynb"


def test_the_examples_are_copied_into_the_persons_folder(tmp_path):
    made = offer_examples({"GPULAB_USER_DIR": str(tmp_path)}, source=EXAMPLES)
    assert made == tmp_path / "examples"
    for f in ("digits_parameter_server.py", "digits_multi_worker.py", NOTEBOOK,
              "tutorial_multi_worker/mnist_setup.py"):
        assert (made / f).read_bytes() == (EXAMPLES / f).read_bytes(), f
    assert not list(made.rglob("__pycache__"))
    assert [p.name for p in tmp_path.iterdir()] == ["examples"]  # no partial copy left


@pytest.mark.parametrize("what", ["folder", "file", "link"])
def test_what_the_person_has_named_examples_is_left_alone(tmp_path, what):
    target = tmp_path / "examples"
    if what == "folder":
        target.mkdir()
        (target / "mine.py").write_text("mine\n")
    elif what == "file":
        target.write_text("mine\n")
    else:
        target.symlink_to(tmp_path / "nowhere")
    assert offer_examples({"GPULAB_USER_DIR": str(tmp_path)}, source=EXAMPLES) is None
    if what == "folder":
        assert [p.name for p in target.iterdir()] == ["mine.py"]
    elif what == "file":
        assert target.read_text() == "mine\n"
    else:
        assert target.is_symlink() and not (tmp_path / "nowhere").exists()


def test_no_folder_or_no_examples_installed_is_no_copy(tmp_path):
    assert offer_examples({}, source=EXAMPLES) is None
    assert offer_examples({"GPULAB_USER_DIR": str(tmp_path)}, source=tmp_path / "none") is None
    assert list(tmp_path.iterdir()) == []


def test_gpulab_installs_the_examples_and_the_launcher_card():
    """The installed copy (pyproject.toml's data-files) is the repository's."""
    installed = installed_examples()
    assert installed == Path(sys.prefix) / "share" / "gpulab" / "examples"
    for f in EXAMPLES.rglob("*"):
        if f.is_file() and "__pycache__" not in f.parts:
            rel = f.relative_to(EXAMPLES)
            assert (installed / rel).read_bytes() == f.read_bytes(), rel
    ext = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "gpulab-launcher"
    assert (ext / "package.json").read_text() == (LABEXT / "package.json").read_text()
    assert (ext / "static" / "remoteEntry.js").read_text() == \
        (LABEXT / "static" / "remoteEntry.js").read_text()


def test_the_launcher_card_is_a_federated_extension_jupyterlab_lists():
    from jupyterlab_server.config import get_federated_extensions

    found = get_federated_extensions([str(Path(sys.prefix) / "share/jupyter/labextensions")])
    build = found["gpulab-launcher"]["jupyterlab"]["_build"]  # what the lab page loads
    assert build == {"load": "static/remoteEntry.js", "extension": "./extension"}
    script = (LABEXT / "static" / "remoteEntry.js").read_text()
    # the container JupyterLab's bootstrap looks for; the notebook it opens comes from the
    # page config, under the key the server extension sets
    assert '_JUPYTERLAB["gpulab-launcher"]' in script
    assert re.search(r'var PAGE_CONFIG_KEY = "gpulabTrainNotebook"', script)
    assert serverext.PAGE_CONFIG_KEY == "gpulabTrainNotebook"
    assert (EXAMPLES / serverext.READY_NOTEBOOK).is_file()


def test_the_card_opens_the_ready_notebook_below_the_servers_root(tmp_path):
    """Locally the server's root is the person's folder: the card opens
    examples/Train a model.ipynb there; a root elsewhere (a home folder on Kubernetes) or
    a person who deleted the notebook gets no card (None)."""
    user = tmp_path / "users" / "ann"
    user.mkdir(parents=True)
    env = {"GPULAB_USER_DIR": str(user)}
    assert serverext.ready_notebook_path(str(user), env) is None  # not copied yet
    offer_examples(env, source=EXAMPLES)
    assert serverext.ready_notebook_path(str(user), env) == "examples/" + NOTEBOOK
    assert serverext.ready_notebook_path(str(tmp_path), env) == \
        "users/ann/examples/" + NOTEBOOK
    home = tmp_path / "home"
    home.mkdir()
    assert serverext.ready_notebook_path(str(home), env) is None
    assert serverext.ready_notebook_path(str(user), {}) is None
    (user / "examples" / NOTEBOOK).unlink()
    assert serverext.ready_notebook_path(str(user), env) is None


def test_the_ready_notebook_runs_the_example_next_to_it():
    nb = nbformat.read(EXAMPLES / NOTEBOOK, 4)
    nbformat.validate(nb)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] for c in nb.cells if c.cell_type == "code")  # shipped clean
    launcher = next(c for c in code if "TrainingLauncher(" in c)
    named = re.search(r'open\("([^"]+)"\)', launcher).group(1)
    assert (EXAMPLES / named).is_file()
    # the README's own words for the launcher's counts
    readme = (ROOT / "README.md").read_text()
    counts = re.search(r"^TrainingLauncher\(([^)]*)\)", readme, re.M).group(1)
    assert launcher.splitlines()[-1].startswith(f"TrainingLauncher({counts}, code=")


def test_the_labextension_also_carries_the_idle_notice_plugin():
    """The same container holds the GPU-idle notification plugin (issue 39), which asks the
    server extension's routes (`idlenotice`) with JupyterLab's own ServerConnection and shows
    JupyterLab 4's Notification; the launcher card's plugin stays beside it. In a real lab:
    tests/e2e/test_idle_notice_browser.py."""
    from gpulab.extensions import idlenotice

    script = (LABEXT / "static" / "remoteEntry.js").read_text()
    assert 'id: "gpulab-launcher:train-a-model"' in script
    assert 'id: "gpulab-launcher:idle-notice"' in script
    assert f'var IDLE_PATH = "{idlenotice.IDLE_PATH}"' in script
    assert f'var KEEP_PATH = "{idlenotice.KEEP_PATH}"' in script
    for module in ("@jupyterlab/launcher", "@jupyterlab/coreutils", "@jupyterlab/apputils",
                   "@jupyterlab/services"):
        assert f'shared("{module}")' in script
    assert "Notification.warning(" in script and '"Keep for "' in script
    poll = int(re.search(r"var POLL_SECONDS = (\d+);", script).group(1))
    assert 30 <= poll <= 60
    # the page loads the module the container answers for, with both plugins in it
    assert "default: found" in script


def test_the_idle_door_answers_this_servers_warnings_only():
    from gpulab.extensions.idlenotice import for_this_server, server_name

    notice = {"id": "a1", "user": "ann", "kind": "notebook", "name": "default", "gpus": 1,
              "idle_since": 100.0, "state": "warned", "stop_at": 700.0, "text": "Your …",
              "can_keep": True}
    view = {"enabled": True, "keep_max_hours": 2, "stopped": [],
            "notices": [notice, {**notice, "id": "a2", "name": "second"},
                        {**notice, "id": "a3", "kind": "job"}],
            "kept": [{"id": "a2", "server": "second", "kept_until": 9000.0}]}
    mine = for_this_server(view, "default")
    assert mine == {"server": "default", "enabled": True, "keep_max_hours": 2,
                    "kept_until": None,
                    "notices": [{"id": "a1", "text": "Your …", "stop_at": 700.0,
                                 "can_keep": True, "gpus": 1, "idle_since": 100.0}]}
    second = for_this_server(view, "second")
    assert [n["id"] for n in second["notices"]] == ["a2"] and second["kept_until"] == 9000.0
    assert for_this_server({"notices": [], "kept": [], "keep_max_hours": 0,
                            "enabled": False}, "default")["enabled"] is False
    assert server_name({}) == "default" and server_name({"JUPYTERHUB_SERVER_NAME": ""}) == \
        "default"
    assert server_name({"JUPYTERHUB_SERVER_NAME": "second"}) == "second"
