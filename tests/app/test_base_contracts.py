"""JupyterHub's ``shell_cmd`` contract (jupyterhub/tests/test_spawner.py ``test_shell_cmd``)
with a real LocalGPUSpawner start: the server is started through the shell, so a variable the
shell's rc file exports reaches the server, also from an rc file below the hub's /tmp while
the server has a private /tmp (`LocalGPUSpawner._tmp_keep` binds its folder back: a server
that is the hub's own account may read it anyway).

Where it cannot hold: an isolated server (``isolate_users``, the default as root) is the
person's own account in a /tmp of its own; upstream's rc file, in root's 0700 pytest folder
below /tmp, is neither visible nor readable there, and must not be: files a ``shell_cmd``
names for isolated servers lie where their accounts may read them (outside /tmp).
"""

import asyncio
import os
import sys

import pytest
import requests
from jupyterhub import orm
from jupyterhub.objects import Hub, Server
from jupyterhub.user import User
from traitlets.config import Config

from gpulab.hub.machine.inventory import GPUInventory
from gpulab.spawner.local import LocalGPUSpawner
from gpulab.spawner.mixin import GPULedger

pytestmark = [pytest.mark.app,
              pytest.mark.skipif(os.geteuid() != 0, reason="a private /tmp needs root")]


@pytest.fixture
def spawner(tmp_path):
    db = orm.new_session_factory("sqlite://")()
    person = orm.User(name="shellcmd")
    db.add(person)
    db.commit()
    c = Config()
    c.GPULedger.db_url = f"sqlite:///{tmp_path / 'gpulab.sqlite'}"
    c.GPUInventory.source = "simulated"
    c.GPUInventory.simulated_gpus = 0
    c.LocalGPUSpawner.isolate_users = False  # the hub's own account (see the docstring)
    c.LocalGPUSpawner.private_tmp_dir = str(tmp_path / "server-tmp")
    c.LocalGPUSpawner.server_log_dir = ""
    GPULedger.clear_instance()
    GPUInventory.clear_instance()
    user = User(person, {"config": c})
    notebooks = tmp_path / "notebooks"  # kept in the private /tmp; the rc file's folder not
    notebooks.mkdir()
    s = user._new_spawner("", spawner_class=LocalGPUSpawner, config=c, hub=Hub(),
                          cmd=[sys.executable, "-m", "jupyterhub.tests.mocksu"],
                          notebook_dir=str(notebooks), default_url="/user/{username}/lab",
                          oauth_client_id="mock-client-id", interrupt_timeout=1,
                          term_timeout=1, kill_timeout=1, poll_interval=1)
    server = orm.Server()
    db.add(server)
    db.commit()
    s.server = Server.from_orm(server)
    yield s
    GPULedger.clear_instance()
    GPUInventory.clear_instance()
    db.close()


async def test_a_variable_of_the_shells_rc_file_reaches_the_server(spawner, tmp_path):
    assert spawner.private_tmp and str(tmp_path).startswith("/tmp/")
    rc = tmp_path / "rc" / "bashrc"
    rc.parent.mkdir()
    rc.write_text("export TESTVAR=foo\n")
    spawner.shell_cmd = ["bash", "--rcfile", str(rc), "-i", "-c"]
    ip, port = await spawner.start()
    try:
        env = None
        for _ in range(200):
            try:
                r = await asyncio.to_thread(requests.get, f"http://{ip}:{port}/env", timeout=2)
                env = r.json()
                break
            except (requests.ConnectionError, ValueError):
                await asyncio.sleep(0.1)
        assert env is not None, "the server never answered"
        assert env["TESTVAR"] == "foo"
    finally:
        await spawner.stop()
