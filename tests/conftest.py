import os
import pwd
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from gpulab.hub.machine.accounts import delete_account

from tests.app.hubctl import Browser, Hub

PASSWORD = "Correct-Horse-42"


def default_prefix_accounts() -> set[str]:
    from gpulab.spawner.local import LocalGPUSpawner

    default = LocalGPUSpawner.system_user_prefix.default_value  # jupyter-
    return {e.pw_name for e in pwd.getpwall() if e.pw_name.startswith(default)}


@pytest.fixture(scope="session", autouse=True)
def no_accounts_left_with_the_default_prefix():
    """Tests make system accounts only with a `prefix` of their own, removed after them: a
    run must not leave one with gpulab's default prefix (such as ``jupyter-user``) behind.
    Not in the cluster tier's pytest that scripts/test.sh runs beside the others
    (``GPULAB_TEST_BESIDE``): it makes no system account, and theirs would count."""
    if os.environ.get("GPULAB_TEST_BESIDE"):
        yield
        return
    before = default_prefix_accounts()
    yield
    left = default_prefix_accounts() - before
    assert not left, f"the tests left system accounts behind: {sorted(left)}"


@pytest.fixture(scope="module")
def prefix():
    """A unique system-account prefix; every account made with it is removed afterwards."""
    p = f"gt{uuid.uuid4().hex[:5]}-"
    yield p
    for entry in pwd.getpwall():
        if entry.pw_name.startswith(p):
            delete_account(entry.pw_name)


@pytest.fixture(scope="module")
def workdir():
    """A folder the users' own accounts can pass through (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="gpulab-test-"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def end_jobs_of(data_dir: Path) -> None:
    """Kill the training replicas started under `data_dir` (jobs outlive `gpulab up` by
    design, so a test's hub leaves a job that a failed test did not finish)."""
    import psutil

    procs = []
    for p in psutil.process_iter(["environ"]):
        job_dir = (p.info["environ"] or {}).get("GPULAB_JOB_DIR", "")
        if job_dir.startswith(str(data_dir) + os.sep):
            procs.append(p)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def hub_with_config(workdir: Path, prefix: str, config: str, gpus: int = 4,
                    subdomains: bool | None = None):
    """A `gpulab up` whose operator's settings file (``<data>/gpulab_config.py``) holds
    `config`, with `gpus` simulated GPUs (`subdomains`: see `Hub`; by default as `gpulab up`
    runs on loopback, each server on a host of its own); a generator for a module fixture
    (yields the hub, then stops it and ends the jobs it left)."""
    data = workdir / "data"
    data.mkdir(mode=0o700)
    (data / "gpulab_config.py").write_text(config)
    (data / "gpulab_config.py").chmod(0o600)
    h = Hub(data, "--simulated-gpus", str(gpus), "--user-prefix", prefix,
            subdomains=subdomains).start()
    yield h
    h.stop()
    end_jobs_of(h.data_dir)


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    # the service looks for vanished servers every 2 s (60 s by default) so that
    # tests/app/test_service_api.py sees it happen
    yield from hub_with_config(workdir, prefix, "c.GPULedger.reconcile_interval = 2\n")


@pytest.fixture(scope="module")
def admin(hub):
    b = Browser(hub, "admin")
    b.login(hub.admin_password)
    return b


@pytest.fixture(scope="module")
def users(hub, admin):
    """Three people who signed up, were approved by the admin, and logged in."""
    made = {}
    for name in ("ann", "bob", "carl"):
        b = Browser(hub, name)
        r = b.signup(PASSWORD)
        assert r.status_code == 200, r.text[:300]
        # not approved yet: the login is refused
        r = b.post_form("/hub/login", {"username": name, "password": PASSWORD}, allow_redirects=False)
        assert r.status_code != 302
        r = admin.approve(name)
        assert r.status_code == 200
        b.login(PASSWORD)
        made[name] = b
    return made


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server (Debian's), started for the session and removed after it."""
    from tests.pg import PostgresServer

    server = PostgresServer().start()
    yield server
    server.stop()
