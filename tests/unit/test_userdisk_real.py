"""gpulab.hub.machine.userdisk on the real kernel (root only): each person's disk is an ext4 image
loop-mounted at their folder; the shared storage is a small tmpfs of the test's own.

What is real: the tmpfs, ``posix_fallocate``, ``mkfs.ext4``, the loop devices, the mounts, the
kernel's ENOSPC at the limit, ``resize2fs`` (offline here: this machine's container lacks
``CAP_SYS_RESOURCE``, which ext4's online resize needs, so a raise while nothing holds the
disk unmounts, grows and mounts it again). Every test leaves no mount and no loop device.
"""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from gpulab.hub.quota.ledger import Ledger
from gpulab.hub.quota.policy import Quota
from gpulab.hub.machine.userdisk import (Disk, DiskError, PersonDisks, ensure_disk, mount_all,
                                     mounts, unmount_all)

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not Path("/dev/loop-control").exists(),
                                reason="loop mounts need root and loop devices")

MiB = 2**20
#: an account that is nobody's here (the disks' owner)
UID = GID = 64123


def _loops_of(shared: Path) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(shared) in line]


@pytest.fixture
def shared():
    """The shared storage: a 200 MiB tmpfs, with users/; unmounted after, with every disk."""
    top = Path(tempfile.mkdtemp(prefix="gpulab-disks-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200M,mode=0755", "tmpfs", str(top)],
                   check=True)
    (top / "users").mkdir()
    try:
        yield top
    finally:
        unmount_all(top)
        left = [p for p, _, _ in mounts() if p.startswith(str(top) + "/")]
        loops = _loops_of(top)
        subprocess.run(["umount", str(top)], check=False)
        top.rmdir()
        assert not left and not loops, (left, loops)  # nothing left behind


def _folder(shared: Path, name: str) -> Path:
    folder = shared / "users" / name
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _fill(folder: Path, mib: int) -> tuple[int, int]:
    """Write up to `mib` MiB into `folder` as the disk's owner; (MiB written, errno)."""
    r = subprocess.run(
        ["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "python3", "-c",
         "import os, sys\n"
         "n, err = 0, 0\n"
         f"fd = os.open('{folder}/fill', os.O_WRONLY | os.O_CREAT, 0o600)\n"
         "try:\n"
         f"    while n < {mib}:\n"
         "        os.write(fd, b'x' * 2**20); n += 1\n"
         "    os.fsync(fd)\n"
         "except OSError as e:\n"
         "    err = e.errno\n"
         "print(n, err)"],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    n, err = r.stdout.split()
    return int(n), int(err)


def test_a_disk_stops_its_owner_at_the_limit_and_nobody_else(shared):
    ann, bob = Disk.of(shared, "ann"), Disk.of(shared, "bob")
    _folder(shared, "ann"), _folder(shared, "bob")
    assert ensure_disk(ann, 48 * MiB, UID, GID).startswith("made a disk")
    assert ensure_disk(bob, 48 * MiB, UID, GID).startswith("made a disk")
    # mounted nosuid,nodev, the root of the file system is theirs, 0700
    opts = subprocess.run(["findmnt", "-n", "-o", "OPTIONS", str(ann.folder)],
                          capture_output=True, text=True).stdout
    assert "nosuid" in opts and "nodev" in opts
    st = os.stat(ann.folder)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (UID, GID, 0o700)
    # the images took their whole size from the tmpfs at once (allocated, not sparse)
    assert os.stat(ann.image).st_blocks * 512 >= 48 * MiB
    written, err = _fill(ann.folder, 100)
    assert err == errno.ENOSPC and written < 48, (written, err)
    # the shared storage and bob's disk still take writes
    (shared / "operator-note").write_bytes(b"y" * MiB)
    assert _fill(bob.folder, 8) == (8, 0)


def test_a_limit_that_the_shared_storage_cannot_hold_is_refused(shared):
    _folder(shared, "ann")
    with pytest.raises(DiskError) as e:
        ensure_disk(Disk.of(shared, "ann"), 400 * MiB, UID, GID)
    assert e.value.status == 507 and "too little room" in e.value.message
    assert not list((shared / ".disks").glob("*.img*"))  # nothing half made


def test_raising_grows_lowering_below_use_is_refused(shared):
    ann = Disk.of(shared, "ann")
    _folder(shared, "ann")
    ensure_disk(ann, 48 * MiB, UID, GID)
    assert ensure_disk(ann, 96 * MiB, UID, GID).startswith(("grew", "resized"))
    assert ann.fs_size()[0] == 96 * MiB and os.statvfs(ann.folder).f_blocks * 4096 > 80 * MiB
    assert _fill(ann.folder, 60) == (60, 0)  # more than the old limit fits now
    with pytest.raises(DiskError) as e:
        ensure_disk(ann, 48 * MiB, UID, GID)
    assert e.value.status == 409 and "does not hold them" in e.value.message
    (ann.folder / "fill").unlink()
    assert ensure_disk(ann, 64 * MiB, UID, GID) == "resized the disk to 64 MiB"
    assert ann.fs_size()[0] == 64 * MiB and os.stat(ann.image).st_size == 64 * MiB


def test_files_from_before_the_limit_move_into_the_disk(shared):
    folder = _folder(shared, "ann")
    (folder / "notes.txt").write_text("kept")
    (folder / "runs").mkdir()
    (folder / "runs" / "a").write_text("1")
    os.chown(folder / "notes.txt", UID, GID)
    ann = Disk.of(shared, "ann")
    ensure_disk(ann, 48 * MiB, UID, GID)
    assert ann.mounted_device() is not None
    assert (folder / "notes.txt").read_text() == "kept" and (folder / "runs" / "a").exists()
    assert os.stat(folder / "notes.txt").st_uid == UID
    unmount_all(shared)
    assert sorted(p.name for p in folder.iterdir()) == []  # moved, not copied beside
    assert mount_all(shared) == ["ann"] and (folder / "notes.txt").read_text() == "kept"


def test_person_disks_follow_the_ledger_and_refuse_a_lower_limit_than_use(shared, tmp_path):
    import pwd

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.migrate()
    entry = pwd.struct_passwd(("ann", "x", UID, GID, "", "/", "/bin/sh"))
    disks = PersonDisks(ledger, shared, lambda user: entry if user == "ann" else None)
    _folder(shared, "ann")
    users = [{"name": "ann", "groups": ["staff"]}, {"name": "bob", "groups": []}]
    assert disks.prepare("ann", ["staff"]) == ""  # no limit: no disk
    ledger.set_quota("group", "staff", Quota(1, disk=48 * MiB), "admin")
    disks.apply(users)
    assert disks.disk("ann").mounted_device() is not None
    assert not disks.disk("bob").image.exists()  # bob has no account: his comes at his start
    _fill(disks.disk("ann").folder, 30)
    why = disks.refusal("group", "staff", Quota(1, disk=32 * MiB), users)
    assert why.status == 409 and why.message.startswith("ann's disk: The files take")
    assert disks.refusal("user", "ann", Quota(1, disk=64 * MiB), users) is None
    assert disks.refusal("default", "", Quota(1, disk=32 * MiB), users) is None  # staff's wins
    # a new disk that the shared storage (200 MiB) cannot hold is refused before it is stored
    ann_disk = disks.disk("ann")
    unmount_all(shared)
    ann_disk.image.unlink()
    why = disks.refusal("user", "ann", Quota(1, disk=300 * MiB), users)
    assert why.status == 507 and "too little room" in why.message


def test_a_server_started_after_the_mount_does_not_hold_the_disk(shared):
    """A server's or replica's mount namespace is a slave of the hub's
    (`gpulab.hub.machine.sandbox`): the disk mounted before it started is unmounted there too
    when the hub unmounts it, so the disk can be resized and its loop device detaches."""
    ann = Disk.of(shared, "ann")
    _folder(shared, "ann")
    ensure_disk(ann, 48 * MiB, UID, GID)
    server = subprocess.Popen(["unshare", "-m", "--propagation", "slave", "sleep", "60"])
    try:
        deadline = time.monotonic() + 5  # its namespace exists, with the disk in it
        while f"{ann.folder} " not in Path(f"/proc/{server.pid}/mountinfo").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ensure_disk(ann, 64 * MiB, UID, GID) in (
            "resized the disk to 64 MiB", "grew the disk to 64 MiB (online)")
        unmount_all(shared)
        assert str(ann.folder) not in Path(f"/proc/{server.pid}/mountinfo").read_text()
        assert not ann.loop_devices()
    finally:
        server.kill()
        server.wait()
