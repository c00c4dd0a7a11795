"""Each person's disk on the shared storage: an ext4 image of their own, loop-mounted at their
folder (``<shared>/users/<name>``), so that the kernel stops their writes at their limit
(ENOSPC) and nobody can fill the filesystem that the others, and the hub, write to.

Why images: ext4 and XFS project quotas need the kernel's quota format (``CONFIG_QFMT_V2``)
and a filesystem mounted with ``prjquota``, which many machines (this development machine
among them) do not have; a loop-mounted ext4 image works on any Linux with loop devices.

- The image is ``<shared>/.disks/<name>.img`` (root's folder, 0700), the size of the limit,
  allocated in full when made or grown (``posix_fallocate``): the limits of everyone together
  can never take more of the shared filesystem than it has (a limit that does not fit is
  refused, `DiskError`), and a full shared filesystem can never fail a write inside an image
  (a loop device over a sparse file would turn that into an I/O error).
- It is made with ``mkfs.ext4 -m 0 -E nodiscard,lazy_itable_init=0,root_owner=<uid>:<gid>``
  (no blocks kept for root; nothing zeroed later, which a loop device would turn into holes;
  the holes mkfs itself punches are allocated again, and again before every mount) and mounted ``nosuid,nodev`` with the loop option, whose
  device detaches itself when the last mount goes (autoclear). Files a person had in their
  folder before they had a limit are copied in first (refused when they do not fit).
- A higher limit grows it: online (``resize2fs`` on the mounted device) where the hub has
  ``CAP_SYS_RESOURCE``; elsewhere (containers drop it, as this machine's does) by unmounting,
  growing offline and mounting again when nothing of the person's holds it, else at the next
  such moment. A lower limit is refused while their files take more (`DiskError`, 409), and
  applied (offline ``resize2fs``) when nothing of theirs holds the disk.
- ``<shared>/users`` is bound onto itself as a shared mount (`share_users_folder`), so that
  the mount namespaces of servers and replicas (slaves of the hub's) see a disk mounted or
  unmounted there after they started, and hold no copy of it once it is unmounted.
- Every operation on one image holds a lock file (``fcntl.flock``): the hub and the gpulab
  service both prepare people's folders. Nothing here may run on an event loop: callers use
  a worker thread.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import struct
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("gpulab.disks")

#: ext4's block size in images (a limit is rounded down to it)
BLOCK = 4096
#: the folder of the images inside the shared storage
IMAGES = ".disks"


class DiskError(RuntimeError):
    """A disk that cannot be made, grown or shrunk as asked; ``message`` is for a person,
    ``status`` the HTTP status that says so (409: their files do not fit; 507: the shared
    storage has no room; 500: the machine could not do it)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.message = message
        self.status = status


def _size_text(size: int) -> str:
    from gpulab.hub.quota.policy import disk_text

    return disk_text(size)


@dataclass(frozen=True)
class Disk:
    """One person's image and where it is mounted."""

    image: Path
    folder: Path

    @classmethod
    def of(cls, shared: str | Path, name: str) -> "Disk":
        """`name`: the person's folder name (`gpulab.hub.machine.accounts.safe_name`)."""
        shared = Path(shared)
        return cls(shared / IMAGES / f"{name}.img", shared / "users" / name)

    # -- what the kernel says --------------------------------------------------------------

    def loop_devices(self) -> list[str]:
        """The loop devices whose backing file is this image (``/dev/loopN``)."""
        found = []
        target = str(self.image.resolve()) if self.image.exists() else str(self.image)
        for entry in Path("/sys/block").glob("loop*"):
            try:
                backing = (entry / "loop" / "backing_file").read_text().strip()
            except OSError:
                continue
            if backing == target:
                found.append(f"/dev/{entry.name}")
        return found

    def mounted_device(self) -> str | None:
        """The device mounted at the folder in this mount namespace (None: not mounted)."""
        want = str(self.folder.resolve()) if self.folder.exists() else str(self.folder)
        for point, source, _ in mounts():
            if point == want:
                return source
        return None

    def fs_size(self) -> tuple[int, int]:
        """``(size, free)`` of the image's file system in bytes, from its superblock."""
        with open(self.image, "rb") as f:
            f.seek(1024)
            sb = f.read(1024)
        if struct.unpack_from("<H", sb, 0x38)[0] != 0xEF53:
            raise DiskError(f"{self.image} holds no ext4 file system", 500)
        block = 1024 << struct.unpack_from("<I", sb, 0x18)[0]
        blocks, free = struct.unpack_from("<I", sb, 0x4)[0], struct.unpack_from("<I", sb, 0xC)[0]
        if struct.unpack_from("<I", sb, 0x60)[0] & 0x80:  # 64bit: the high words
            blocks |= struct.unpack_from("<I", sb, 0x150)[0] << 32
            free |= struct.unpack_from("<I", sb, 0x158)[0] << 32
        return blocks * block, free * block

    def used(self) -> int:
        """Bytes the person's files take now (the mounted file system's, else the image's)."""
        if self.mounted_device():
            st = os.statvfs(self.folder)
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        if self.image.exists():
            size, free = self.fs_size()
            return size - free
        return folder_usage(self.folder)


def share_users_folder(shared: str | Path) -> None:
    """Make ``<shared>/users`` a shared mount (a bind mount of itself, as systemd's ``/``
    is), so that a person's disk mounted or unmounted under it reaches the mount namespaces
    of servers and replicas too (`gpulab.hub.machine.sandbox` makes theirs slaves of this one):
    otherwise every server started after a disk was mounted would keep a private copy of
    it, and the disk could not be resized or detached until that server ended."""
    users = Path(shared) / "users"
    users.mkdir(mode=0o755, exist_ok=True)
    point = str(users.resolve())
    info = [fields for fields in _mountinfo() if fields[0] == point]
    if not info:
        # recursive: disks mounted there already come along
        _run(["mount", "--rbind", point, point], "Binding the people's folders")
    elif any(f.startswith("shared:") for f in info[-1][1]):
        return
    _run(["mount", "--make-shared", point], "Sharing the people's folders' mount")


def _unshare_users_folder(shared: str | Path) -> None:
    point = str((Path(shared) / "users").resolve())
    if any(fields[0] == point for fields in _mountinfo()):
        _umount(Path(point))


def _mountinfo() -> list[tuple[str, list[str]]]:
    """``(mount point, optional fields)`` of this mount namespace, in mount order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left = line.partition(" - ")[0].split()
            if len(left) >= 6:
                out.append((_unescape(left[4]), left[6:]))
    return out


def mounts() -> list[tuple[str, str, str]]:
    """``(mount point, source, fs type)`` of this mount namespace (``/proc/self/mountinfo``)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 2:
                out.append((_unescape(fields[4]), tail[1], tail[0]))
    return out


def _unescape(path: str) -> str:
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def folder_usage(folder: Path) -> int:
    """Bytes the files under `folder` take (``du``'s blocks), not following links."""
    total = 0
    for root, dirs, files in os.walk(folder):
        for n in dirs + files:
            try:
                total += os.lstat(os.path.join(root, n)).st_blocks * 512
            except OSError:
                pass
    return total


def _run(cmd: list[str], what: str, status: int = 500) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise DiskError(f"{what} failed: {(r.stderr or r.stdout).strip()[-400:]}", status)
    return r


@contextmanager
def _locked(disk: Disk):
    """The image's lock (between the hub's and the service's processes)."""
    disk.image.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(disk.image.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _allocate(image: Path, size: int) -> None:
    """The image file, `size` bytes, every block allocated (ENOSPC: `DiskError` 507)."""
    fd = os.open(image, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(image.parent).free
            raise DiskError(
                f"The shared storage has too little room for a disk of {_size_text(size)} "
                f"({_size_text(free)} free): free some, or choose a smaller limit.", 507) from e
        raise DiskError(f"Could not allocate {image}: {e.strerror}", 500) from e
    finally:
        os.close(fd)


def _mount(source: str, folder: Path, loop: bool) -> None:
    opts = "loop,nosuid,nodev" if loop else "nosuid,nodev"
    _run(["mount", "-t", "ext4", "-o", opts, source, str(folder)], f"Mounting {source}")


def _umount(folder: Path) -> None:
    r = subprocess.run(["umount", str(folder)], capture_output=True, text=True)
    if r.returncode != 0:  # something of root's has a file open there: detach it anyway
        _run(["umount", "-l", str(folder)], f"Unmounting {folder}")


def ensure_disk(disk: Disk, size: int, uid: int, gid: int) -> str:
    """Make, resize and mount `disk` for a limit of `size` bytes, owned by ``uid:gid``; the
    folder exists. Returns what was done, in words (for the log). `DiskError` when the limit
    cannot be had (the person's files take more, the shared storage has no room)."""
    size = size // BLOCK * BLOCK
    with _locked(disk):
        share_users_folder(disk.folder.parent.parent)
        if (disk.mounted_device() is None and not disk.loop_devices() and _has_files(disk.folder)
                and _busy(uid)):
            # their files would move into the disk under a running program of theirs
            log.info("The disk of %s waits until nothing of theirs runs (files to move in)",
                     disk.folder)
            return "the disk is made when nothing of theirs runs"
        if not disk.image.exists():
            _create(disk, size, uid, gid)
            done = f"made a disk of {_size_text(size)}"
        else:
            done = ""
        device = disk.mounted_device()
        if device is not None:
            current, _ = disk.fs_size()
            if current != size:
                done = _resize_mounted(disk, device, current, size) or done
        else:
            attached = disk.loop_devices()
            if attached:  # still in use in another mount namespace (a job's): share it
                _mount(attached[0], disk.folder, loop=False)
                done = done or "mounted the disk in use"
            else:
                _resize_offline(disk, size)
                _allocate(disk.image, disk.image.stat().st_size)  # holes of before, if any
                _adopt_files(disk)
                _mount(str(disk.image), disk.folder, loop=True)
                done = done or f"mounted the disk of {_size_text(size)}"
        # the file system's root is the person's folder: theirs, 0700
        os.chown(disk.folder, uid, gid)
        os.chmod(disk.folder, 0o700)
        return done


def _has_files(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError:
        return False


def _busy(uid: int) -> bool:
    """Whether a process of the account `uid` runs (a server, a replica, a terminal)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    return True
            except OSError:
                pass
    return False


def _create(disk: Disk, size: int, uid: int, gid: int) -> None:
    need = folder_usage(disk.folder)
    if need and need > size * 0.9:
        raise DiskError(f"The files in the folder take {_size_text(need)}, which does not fit "
                        f"in a disk of {_size_text(size)}: choose a larger limit.")
    part = disk.image.with_suffix(".new")
    part.unlink(missing_ok=True)
    try:
        _allocate(part, size)
        # every inode table and the journal written now (no lazy zeroing later, which a loop
        # device turns into holes punched in the image)
        _run(["mkfs.ext4", "-q", "-F", "-b", str(BLOCK), "-m", "0", "-L", "gpulab-user",
              "-E", f"nodiscard,lazy_itable_init=0,lazy_journal_init=0,root_owner={uid}:{gid}",
              str(part)], "mkfs.ext4")
        _allocate(part, size)  # mkfs punches holes where it zeroes: allocated again
        os.rename(part, disk.image)
    finally:
        part.unlink(missing_ok=True)


def _resize_offline(disk: Disk, size: int) -> None:
    """Resize the image (not mounted anywhere) to `size`."""
    current, free = disk.fs_size()
    if current == size and disk.image.stat().st_size == size:
        return
    if size < current and size < (current - free) + 8 * 2**20:
        raise DiskError(f"The files take {_size_text(current - free)}: a limit of "
                        f"{_size_text(size)} does not hold them. Delete some first, or choose "
                        "a larger limit.")
    _run(["e2fsck", "-f", "-p", str(disk.image)], "e2fsck")
    if size > current:
        _allocate(disk.image, size)
        _run(["resize2fs", str(disk.image)], "resize2fs")
    else:
        _run(["resize2fs", str(disk.image), f"{size // 1024}K"], "resize2fs", 409)
        os.truncate(disk.image, size)


def _resize_mounted(disk: Disk, device: str, current: int, size: int) -> str:
    """Resize a mounted disk: grow online where the kernel lets us; else (or to shrink)
    unmount, resize offline and mount again when nothing else holds it."""
    used = disk.used()
    if size < current and size < used + 8 * 2**20:
        raise DiskError(f"The files take {_size_text(used)}: a limit of {_size_text(size)} does "
                        "not hold them. Delete some first, or choose a larger limit.")
    if size > current:
        _allocate(disk.image, size)
        subprocess.run(["losetup", "-c", device], capture_output=True)
        if subprocess.run(["resize2fs", device], capture_output=True).returncode == 0:
            return f"grew the disk to {_size_text(size)} (online)"
    # offline: only when this namespace's mount is the last user of the device
    _umount(disk.folder)
    if _still_held(disk):  # a server or job of theirs holds it: back as it was
        _mount(device, disk.folder, loop=False)
        log.info("The disk %s is in use; it becomes %s when nothing holds it", disk.image,
                 _size_text(size))
        return f"the disk becomes {_size_text(size)} once nothing of theirs runs"
    try:
        _resize_offline(disk, size)
    finally:
        _mount(str(disk.image), disk.folder, loop=True)
    return f"resized the disk to {_size_text(size)}"


def _still_held(disk: Disk, wait: float = 3) -> bool:
    """Whether the image's loop device stays attached after this namespace's mount went:
    the kernel detaches an autoclear device in the background, so it is given `wait`
    seconds (a mount of a server or job of theirs keeps it for as long as that runs)."""
    deadline = time.monotonic() + wait
    while disk.loop_devices():
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False


def _adopt_files(disk: Disk) -> None:
    """Move files left in the (unmounted) folder into the image, owners and modes kept."""
    if not disk.folder.is_dir() or not any(disk.folder.iterdir()):
        return
    scratch = Path(tempfile.mkdtemp(prefix="adopt-", dir=disk.image.parent))
    try:
        _mount(str(disk.image), scratch, loop=True)
        try:
            r = subprocess.run(["cp", "-a", "--", f"{disk.folder}/.", f"{scratch}/"],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise DiskError(f"The files in {disk.folder} do not fit in their disk "
                                f"({r.stderr.strip()[-200:]}): choose a larger limit.")
        finally:
            _umount(scratch)
    finally:
        scratch.rmdir()
    for entry in list(disk.folder.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    log.info("Moved the files of %s into its disk %s", disk.folder, disk.image)


def check_limit(disk: Disk, size: int) -> None:
    """`DiskError` (409) when the person's files take more than a new limit of `size`."""
    if not disk.image.exists():
        return
    with _locked(disk):
        used = disk.used()
    if size < used + 8 * 2**20:
        raise DiskError(f"The files take {_size_text(used)}: a disk limit of "
                        f"{_size_text(size)} does not hold them. They must delete some first, "
                        "or choose a larger limit.")


def mount_all(shared: str | Path) -> list[str]:
    """Mount every image at its folder (the hub's start: what a job or server of a person
    writes goes into their disk from the first moment). Returns the names mounted."""
    done = []
    root = Path(shared) / IMAGES
    images = sorted(root.glob("*.img")) if root.is_dir() else []
    if images:
        try:
            share_users_folder(shared)
        except DiskError as e:
            log.error("%s", e)
    for image in images:
        disk = Disk.of(shared, image.stem)
        try:
            with _locked(disk):
                if disk.mounted_device() is not None or not disk.folder.is_dir():
                    continue
                attached = disk.loop_devices()
                if attached:
                    _mount(attached[0], disk.folder, loop=False)
                else:
                    _run(["e2fsck", "-p", str(disk.image)], "e2fsck")
                    _allocate(disk.image, disk.image.stat().st_size)
                    _adopt_files(disk)
                    _mount(str(disk.image), disk.folder, loop=True)
                done.append(image.stem)
        except (DiskError, OSError) as e:
            log.error("Could not mount the disk %s: %s", image, e)
    return done


def unmount_all(shared: str | Path, wait: float = 10) -> list[str]:
    """Unmount every person's disk (the hub's stop; `gpulab` uninstall); their loop devices
    detach themselves once nothing holds them (autoclear; waited for up to `wait` seconds).
    Returns the names unmounted."""
    done = []
    root = Path(shared) / IMAGES
    images = sorted(root.glob("*.img")) if root.is_dir() else []
    for last in (False, True):
        for image in images:
            disk = Disk.of(shared, image.stem)
            try:
                with _locked(disk):
                    while disk.mounted_device() is not None:
                        _umount(disk.folder)
                    if not last:
                        done.append(image.stem)
            except (DiskError, OSError) as e:
                log.error("Could not unmount the disk %s: %s", image, e)
        if not last:
            try:  # the people's folders' own bind mount (`share_users_folder`); a disk it
                # covered (mounted before it) is unmounted in the second round
                _unshare_users_folder(shared)
            except (DiskError, OSError) as e:
                log.error("Could not unmount %s/users: %s", shared, e)
    # the kernel detaches an autoclear loop device after its last user, in the background
    deadline = time.monotonic() + wait
    disks = [Disk.of(shared, name) for name in done]
    while (held := [d for d in disks if d.loop_devices()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for d in held:
        log.warning("The disk %s is still held (a training job of theirs that goes on?); its "
                    "loop device detaches when that ends", d.image)
    return done


class PersonDisks:
    """The disks of a hub's people, sized from the quota ledger (the gpulab service's: job
    starts, quota changes). ``accounts``: hub user -> their system account's passwd entry,
    None when they have none yet. Every method blocks: call it in a worker thread."""

    def __init__(self, ledger, shared: str | Path, accounts):
        self.ledger, self.shared, self.accounts = ledger, Path(shared), accounts

    def disk(self, user: str) -> Disk:
        from gpulab.hub.machine.accounts import safe_name

        return Disk.of(self.shared, safe_name(user))

    def prepare(self, user: str, groups) -> str:
        """Their disk before their work starts (none without a limit)."""
        size, _ = self.ledger.disk_limit(user, groups)
        entry = self.accounts(user)
        if size is None or entry is None:
            return ""
        return ensure_disk(self.disk(user), size, entry.pw_uid, entry.pw_gid)

    def refusal(self, scope: str, name: str, quota, users: list[dict]) -> DiskError | None:
        """Why `quota` cannot be stored as the ``scope``/``name`` quota (None: it can): it
        would leave somebody with less disk than their files take (409), or a new disk of
        the person it names would not fit in the shared storage (507). `users`: the hub's,
        with their groups."""
        from gpulab.hub.quota.policy import effective_disk

        rows = {(q["scope"], q["name"]): q for q in self.ledger.quotas()}
        as_quota = {k: _quota(q) for k, q in rows.items()}
        as_quota[(scope, name)] = quota
        for u in users:
            disk = self.disk(u["name"])
            if not disk.image.exists():
                room = shutil.disk_usage(self.shared).free
                if (scope == "user" and u["name"] == name and quota.disk is not None
                        and quota.disk > room and self.accounts(name) is not None):
                    return DiskError(f"{name}'s disk: the shared storage has too little room "
                                     f"for a disk of {_size_text(quota.disk)} "
                                     f"({_size_text(room)} free).", 507)
                continue
            groups = {g: as_quota[("group", g)] for g in u["groups"] if ("group", g) in as_quota}
            size, _ = effective_disk(as_quota.get(("default", "")), groups,
                                     as_quota.get(("user", u["name"])))
            if size is None:
                continue  # no limit any more: their disk keeps its size
            try:
                check_limit(disk, size)
            except DiskError as e:
                return DiskError(f"{u['name']}'s disk: {e.message}", e.status)
        return None

    def apply(self, users: list[dict]) -> None:
        """Bring everyone's disk to their limit now (after a quota change): existing disks
        are resized, and a person with an account and a new limit gets theirs. Errors are
        logged (their next start says them)."""
        for u in users:
            try:
                done = self.prepare(u["name"], u["groups"])
            except (DiskError, OSError) as e:
                log.warning("The disk of %s stays as it is: %s", u["name"], e)
                continue
            if done:
                log.info("Disk of %s: %s", u["name"], done)


def _quota(row: dict):
    from gpulab.hub.quota.policy import Quota

    return Quota(row["max_gpus"], row["max_per_request"], row["gpu_hours"],
                 row["window_hours"], row.get("disk"))
