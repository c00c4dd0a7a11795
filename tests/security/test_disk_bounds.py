"""Issue 36 item 3: one person filling the shared storage stops nobody else.

The whole hub of this module (its data folder, databases and shared storage) lives on a
400 MiB tmpfs of its own, as in the issue's reproduction. eve and vic each have a 64 MiB disk
(`disk` in their quotas, set by the admin before their first start): an ext4 image
loop-mounted at their folder (`gpulab.hub.machine.userdisk`). eve writes until the kernel says
ENOSPC at her limit; vic then logs in, reads the hub's API, saves a file in his server and
submits a job. Then the tmpfs itself is filled (by root, as a person without a limit could):
tokens are still accepted (JupyterHub's activity write used to fail the token check, 403 for
everyone), and vic's save still lands in his own disk. Afterwards no mount and no loop device
is left.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import requests

from tests.app.hubctl import Browser
from tests.conftest import PASSWORD
from tests.security.conftest import _person

MiB = 2**20
LIMIT = "64M"


@pytest.fixture(scope="module")
def workdir(prefix):
    """The hub's folder: a 400 MiB tmpfs of its own. After the hub stopped, none of the
    people's disks may be mounted here, and none may be held by a process of this hub or of
    its people. (A mount namespace that some other program on the machine made while the
    disks were mounted holds a copy of them, by the kernel's rule, until it ends: its loop
    devices detach then; such holders are waited for a while and reported, not failed.)"""
    d = Path(tempfile.mkdtemp(prefix="gpulab-test-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400M,mode=0711", "tmpfs", str(d)],
                   check=True)
    try:
        yield d
    finally:
        from gpulab.hub.machine.userdisk import mounts, unmount_all

        shared = d / "data" / "shared"
        unmount_all(shared)  # the hub's stop did it already, unless it was killed
        left = [p for p, _, _ in mounts() if p.startswith(str(d) + "/")]
        deadline = time.monotonic() + 20
        while (loops := _loops(d)) and time.monotonic() < deadline:
            time.sleep(0.2)
        holders = [pid for pid in _holders(d) if _ours(pid, d, prefix)]
        if loops and not holders:
            warnings.warn(f"{len(loops)} loop device(s) of this test's disks are held by mount "
                          f"namespaces made elsewhere on the machine (pids "
                          f"{_holders(d)[:10]}): they detach when those end")
        if subprocess.run(["umount", str(d)]).returncode != 0:
            subprocess.run(["umount", "-l", str(d)])
        shutil.rmtree(d, ignore_errors=True)
        assert not left and not holders, (left, holders, loops)


def _loops(d: Path) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(d) in line]


def _holders(d: Path) -> list[str]:
    """The processes whose mount namespace still has something mounted under `d`."""
    return sorted({f.split("/")[2] for f in _mountinfos() if f"{d}/" in _read(f)}, key=int)


def _ours(pid: str, d: Path, prefix: str) -> bool:
    """Whether `pid` is this test's: the hub's or a server's or a replica's (it names the
    test's folder) or a process of one of the test's accounts."""
    import pwd

    try:
        owner = pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except (OSError, KeyError):
        owner = ""
    text = _read(f"/proc/{pid}/cmdline") + _read(f"/proc/{pid}/environ")
    return owner.startswith(prefix) or str(d) in text


def _mountinfos() -> list[str]:
    return [f"/proc/{p}/mountinfo" for p in os.listdir("/proc") if p.isdigit()]


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def limited(hub, admin):
    """eve's and vic's quotas give them 64 MiB disks before their first start."""
    for who in ("eve", "vic"):
        r = admin.service("PUT", f"quotas/users/{who}", json={"max_gpus": 4, "disk": LIMIT})
        assert r.status_code == 200 and r.json()["disk"] == 64 * MiB, r.text


@pytest.fixture(scope="module")
def vic(hub, admin, prefix, limited):
    return _person(hub, admin, prefix, "vic")


@pytest.fixture(scope="module")
def eve(hub, admin, prefix, limited):
    return _person(hub, admin, prefix, "eve")


def folder(hub, name: str) -> Path:
    return hub.data_dir / "shared" / "users" / name


def mount_of(path: Path) -> str:
    return subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "--mountpoint",
                           str(path)], capture_output=True, text=True).stdout.strip()


def save(person: Browser, name: str, text: str, token: str | None = None) -> requests.Response:
    """A save in the person's own notebook server (JupyterLab's contents API)."""
    return requests.put(person.hub.user_url(person.name) + f"api/contents/{name}",
                        headers={"Authorization": f"token {token or person.token()}"},
                        json={"type": "file", "format": "text", "content": text}, timeout=30)


def hub_answers(person: Browser, token: str | None = None) -> None:
    """Who-am-I at the hub and at the gpulab service, with the person's token."""
    r = requests.get(person.hub.url + "/hub/api/user",
                     headers={"Authorization": f"token {token or person.token()}"}, timeout=30)
    assert r.status_code == 200 and r.json()["name"] == person.name, (r.status_code, r.text)
    r = person.service("GET", "me", token=token, timeout=30)
    assert r.status_code == 200 and r.json()["user"] == person.name, (r.status_code, r.text)


def test_eve_fills_her_disk_and_vic_goes_on(hub, admin, vic, eve):
    for who in ("eve", "vic"):  # each folder is a disk of its own, nosuid,nodev
        source = mount_of(folder(hub, who))
        assert source.startswith("/dev/loop") and " ext4 " in source, source
        assert "nosuid" in source and "nodev" in source
    # eve writes as much as she can into her folder (her terminal)
    r = eve.sh(f"dd if=/dev/zero of={folder(hub, 'eve')}/fill bs=1M count=300 2>&1; "
               f"stat -c %s {folder(hub, 'eve')}/fill")
    assert "No space left on device" in r.stdout, r.stdout
    written = int(r.stdout.split()[-1])
    assert 40 * MiB < written < 64 * MiB, written  # stopped by the kernel at her limit
    r = eve.sh("head -c 1048576 /dev/zero > $D/more", env={"D": str(folder(hub, "eve"))})
    assert r.returncode != 0 and "No space left on device" in r.stderr, r
    # the shared storage itself (and the hub's databases on it) kept its room
    assert shutil.disk_usage(hub.data_dir).free > 100 * MiB

    # vic: a fresh login, the hub's API, a save in his server, a job
    fresh = Browser(hub, "vic")
    fresh.login(PASSWORD)
    hub_answers(vic)
    r = save(vic, "after-eve.txt", "vic's work")
    assert r.status_code in (200, 201), r.text
    assert (folder(hub, "vic") / "after-eve.txt").read_text() == "vic's work"
    r = vic.service("POST", "jobs", json={
        "name": "after-eve", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
        "resources": {"worker": {"gpus": 0}}, "source": "print('ok')", "max_runtime": 120})
    assert r.status_code in (201, 202), r.text
    assert vic.service("POST", "jobs/after-eve/stop").status_code in (200, 202)
    assert requests.get(hub.url + "/hub/api", timeout=10).status_code == 200


def test_a_limit_below_her_files_is_refused_and_a_higher_one_grows_her_disk(hub, admin, eve):
    r = admin.service("PUT", "quotas/users/eve", json={"max_gpus": 4, "disk": "40M"})
    assert r.status_code == 409 and r.json()["field"] == "disk", r.text
    assert "eve's disk: The files take" in r.json()["message"]
    assert admin.service("GET", "quotas/users/eve").json()["disk"] == 64 * MiB  # not stored
    r = admin.service("PUT", "quotas/users/eve", json={"max_gpus": 4, "disk": "lots"})
    assert r.status_code == 400 and r.json()["field"] == "disk", r.text
    # higher: her server holds the disk now, so it grows once nothing of hers runs (online
    # growth needs CAP_SYS_RESOURCE, which this machine's container lacks)
    r = admin.service("PUT", "quotas/users/eve", json={"max_gpus": 4, "disk": "96M"})
    assert r.status_code == 200 and r.json()["disk"] == 96 * MiB, r.text
    eve.stop_server()
    assert eve.start_server().status_code in (201, 202)
    st = os.statvfs(folder(hub, "eve"))
    foreign = [p for p in _holders(hub.data_dir.parent)
               if not _ours(p, hub.data_dir.parent, eve.prefix)]
    if st.f_blocks * st.f_frsize < 80 * MiB and foreign:
        pytest.skip(f"eve's disk is held by mount namespaces made elsewhere on this machine "
                    f"while it was mounted (pids {foreign[:5]}): it grows when they end "
                    "(the refusal above was checked; growth: tests/unit/test_userdisk_real.py)")
    assert st.f_blocks * st.f_frsize > 80 * MiB  # the file system is 96 MiB now
    assert eve.sh(f"dd if=/dev/zero of={folder(hub, 'eve')}/more2 bs=1M count=20 2>&1"
                  ).returncode == 0  # room beyond her old limit
    assert (folder(hub, "eve") / "fill").stat().st_size > 40 * MiB  # her files kept
    (folder(hub, "eve") / "fill").unlink()


def test_a_full_shared_storage_still_takes_tokens_and_saves_in_own_disks(hub, vic):
    """The issue's reproduction: the tmpfs that holds the hub's databases is full (here
    filled by root, as a person without a disk limit could). Token checks record activity in
    the hub's database; that write failing refused every token (403) before."""
    filler = hub.data_dir.parent / "filler"
    # tokens never used yet: their first check records their activity (a write)
    fresh = [vic.api("POST", "/users/vic/tokens", json={"note": f"full-{i}"}).json()["token"]
             for i in range(2)]
    try:
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * MiB)
                    f.flush()
            except OSError:
                pass
        assert shutil.disk_usage(hub.data_dir).free < MiB
        hub_answers(vic, fresh[0])
        r = save(vic, "while-full.txt", "still saved", fresh[1])  # into his own disk
        assert r.status_code in (200, 201), r.text
        assert (folder(hub, "vic") / "while-full.txt").read_text() == "still saved"
    finally:
        filler.unlink(missing_ok=True)
    hub_answers(vic)
