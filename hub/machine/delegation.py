"""Where gpulab makes its control groups when systemd runs it with ``Delegate=yes``.

On the unified hierarchy (cgroup v2) systemd owns every group except those it delegates. The
unit ``gpulab service install`` writes has ``Delegate=yes``: the service gets its group,
``/sys/fs/cgroup/system.slice/gpulab.service``, to divide as it likes. The groups of servers
and replicas then belong inside it, not at the top of the hierarchy, where systemd does not
expect them and where what the operator sets on the service (``MemoryMax=``, ``systemctl
stop``) would not reach them.

The kernel lets a v2 group hand controllers down to child groups only while it holds no
process itself ("no internal processes"), so the hub first moves the unit's processes
(itself and whatever it started already) into a leaf of its own, `HUB_LEAF`; gpulab's groups
go beside it, where `gpulab.hub.machine.cgroups.Cgroups.detect` puts them under its top folder:

    system.slice/gpulab.service/    delegated by systemd (trusted.delegate = 1)
      hub/                          the hub, the proxy, the gpulab service
      gpulab/<unit>/                each server and replica

A group counts as delegated where systemd marked it so: the ``trusted.delegate`` extended
attribute (``user.delegate`` for a user's manager), set to ``1`` on the group of a unit with
``Delegate=yes``. Only the process's own group, or the parent of its `HUB_LEAF`, is looked
at, never a farther ancestor: a root shell inside a person's ``user@.service`` (delegated to
that person's manager) is not gpulab's to divide.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

log = logging.getLogger("gpulab.cgroups")

#: the leaf of the delegated group that holds the hub and its own processes
HUB_LEAF = "hub"
_MARKS = ("trusted.delegate", "user.delegate")


def own_v2_group(self_cgroup: str | Path = "/proc/self/cgroup") -> str | None:
    """This process's group in the v2 hierarchy (``/system.slice/x.service``), from the
    ``0::`` line of `self_cgroup`; None without one."""
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return line[3:]
    return None


def is_delegated(folder: Path) -> bool:
    """Whether systemd marked `folder` (a v2 group) as delegated."""
    for name in _MARKS:
        try:
            if os.getxattr(folder, name).strip() == b"1":
                return True
        except OSError as e:
            if e.errno not in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT, errno.EPERM):
                raise
    return False


def delegated_top(fs_root: str | Path = "/sys/fs/cgroup",
                  self_cgroup: str | Path = "/proc/self/cgroup") -> Path | None:
    """The delegated group this process runs in (the folder under `fs_root`), with every
    process of it moved into its `HUB_LEAF` (made if need be); None where this process's
    group is not delegated (a terminal, cgroup v1, no systemd): nothing is moved then.

    Safe to call more than once: once the processes are in the leaf, the leaf's parent is
    found and nothing moves again.
    """
    fs_root = Path(fs_root)
    own = own_v2_group(self_cgroup)
    if not own or own == "/":
        return None
    group = fs_root / own.lstrip("/")
    if is_delegated(group):
        top = group
    elif group.name == HUB_LEAF and is_delegated(group.parent):
        return group.parent
    else:
        return None
    leaf = top / HUB_LEAF
    moved = []
    try:
        leaf.mkdir(exist_ok=True)
        # the processes may fork meanwhile: read the list again until it is empty
        for _ in range(100):
            pids = (top / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:
                try:
                    (leaf / "cgroup.procs").write_text(pid)
                    moved.append(pid)
                except ProcessLookupError:
                    pass
    except OSError as e:
        # then gpulab's groups could not hand controllers down there either
        log.warning("Delegated control group %s, but its processes cannot move into %s/: "
                    "%s; not using it", top, HUB_LEAF, e.strerror or e)
        return None
    log.info("Delegated control group %s: moved processes %s into %s/", top,
             " ".join(moved), HUB_LEAF)
    return top
