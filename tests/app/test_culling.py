"""Idle culling through jupyterhub-idle-culler, on a hub whose users are not isolated.

A hub of its own: a short idle timeout, two simulated GPUs, and ``--no-isolation`` so that
`gpulab up` must warn that users can read each other's files.
"""

import time

import pytest

from .hubctl import Hub

pytestmark = pytest.mark.app


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    h = Hub(workdir / "data", "--simulated-gpus", "2", "--idle-timeout", "6",
            "--cull-every", "2", "--no-isolation").start()
    yield h
    h.stop()


def test_not_isolated_is_said_loudly(hub):
    out = hub.output()
    assert "WARNING users are NOT isolated from each other" in out
    assert "can read every user's files" in out


def test_idle_server_is_culled_and_its_gpus_come_back(users, hub):
    ann, bob = users["ann"], users["bob"]
    r = ann.start_server("", {"profile": "gpu-2"})
    assert r.status_code in (201, 202), (r.text, hub.output()[-12000:])
    # both GPUs are held now
    r = bob.start_server("", {"profile": "gpu-1"})
    assert r.status_code == 409, r.text

    deadline = time.time() + 90
    while time.time() < deadline:
        if not ann.api("GET", "/users/ann").json()["servers"]:
            break
        time.sleep(1)
    else:
        pytest.fail("the idle culler did not stop ann's idle server")

    culler_log = hub.output()
    assert "idle-culler" in culler_log
    assert bob.start_server("", {"profile": "gpu-2"}).status_code in (201, 202)
    bob.stop_server()


def test_the_culler_and_the_service_end_when_the_hub_is_killed(hub):
    import signal

    import psutil

    hub_proc = psutil.Process(hub.proc.pid)
    managed = [p for p in hub_proc.children()
               if any(m in " ".join(p.cmdline()) for m in ("gpulab.hub.deploy.culler",
                                                             "gpulab.hub.service "))]
    assert len(managed) == 2, [p.cmdline() for p in hub_proc.children()]
    hub.proc.send_signal(signal.SIGKILL)
    hub.proc.wait(10)
    _, alive = psutil.wait_procs(managed, timeout=15)
    assert not alive, [p.cmdline() for p in alive]
    # the proxy outlives its hub by design (a new `gpulab up` adopts it): end it here
    proxy = int((hub.data_dir / "proxy.pid").read_text())
    psutil.Process(proxy).terminate()
