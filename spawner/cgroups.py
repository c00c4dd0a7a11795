"""CPU and memory limits for local notebook servers and training replicas (Linux control groups).

In local mode a profile's ``cpu_limit`` / ``mem_limit`` and a job role's ``cpu`` / ``memory`` are
enforced by putting the process in a control group of its own, made by gpulab:

- **cgroup v2** (the unified hierarchy, ``/sys/fs/cgroup/cgroup.controllers`` lists ``cpu`` and
  ``memory``): groups ``/sys/fs/cgroup/gpulab/<unit>`` with ``memory.max``, ``memory.swap.max``
  = 0 and ``cpu.max``. ``gpulab`` sits at the top of the hierarchy because a group that holds
  processes (the hub's own) may not hand controllers down to child groups.
- **cgroup v1** (``memory`` and ``cpu`` hierarchies): groups ``<hierarchy>/<the hub's group>/
  gpulab/<unit>`` with ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap
  is accounted) and ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, nested under the hub's own
  group so that whatever already limits the hub keeps limiting what it starts.

The child process joins its group in ``preexec_fn`` (as root, before it drops to the user's
account), so everything it starts is inside too. Making groups needs root and a writable
hierarchy: without them limits are not enforced, and `detect` says why (the hub logs it once).
A process killed by the memory limit is told apart by `Group.oom_kills`.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("gpulab.cgroups")

#: the CPU bandwidth period written with a CPU limit (microseconds; the kernel's default)
CPU_PERIOD_US = 100_000
_UNIT = re.compile(r"[^A-Za-z0-9_.-]+")

_MEMORY_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                 "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def memory_bytes(value: str | int | float | None) -> int | None:
    """Bytes of a Kubernetes-style quantity (``512Mi``, ``2G``, ``1.5Gi``, ``1000``), or None."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|K|M|G|T)?", value.strip())
    if not m:
        raise ValueError(f"{value!r} is not a memory size such as 512Mi or 2G")
    return int(float(m.group(1)) * _MEMORY_UNITS[m.group(2) or ""])


@dataclass
class Group:
    """One unit's control group (one folder per hierarchy under v1, one under v2)."""

    unit: str
    version: int
    dirs: dict[str, Path] = field(default_factory=dict)  # controller ("memory", "cpu") -> folder

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in dict.fromkeys(self.dirs.values())]

    def join(self, pid: int | None = None) -> None:
        """Move ``pid`` (default: this process) into the group. Safe in ``preexec_fn``."""
        me = str(pid or os.getpid())
        for f in self.procs_files:
            with open(f, "w") as out:
                out.write(me)

    def pids(self) -> list[int]:
        out: set[int] = set()
        for f in self.procs_files:
            try:
                out.update(int(x) for x in f.read_text().split())
            except OSError:
                pass
        return sorted(out)

    def oom_kills(self) -> int:
        """How many processes of the group the memory limit killed."""
        d = self.dirs.get("memory")
        if d is None:
            return 0
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (d / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, kill: bool = True, timeout: float = 5.0) -> bool:
        """Remove the group, first killing what is left in it (``kill``); False if it
        could not be removed (processes still there)."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.pids()
            if left and kill:
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            ok = True
            for d in dict.fromkeys(self.dirs.values()):
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                        raise
                    ok = False
            if ok:
                # gpulab's folder goes too once empty: nothing of gpulab is left in the
                # hierarchy (the next `make` makes it again)
                for d in dict.fromkeys(d.parent for d in self.dirs.values()):
                    try:
                        d.rmdir()
                    except OSError:
                        pass
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


@dataclass
class Cgroups:
    """Where gpulab makes its groups: `detect` finds it, `make` makes one unit's group."""

    version: int
    bases: dict[str, Path]  # controller -> the folder holding gpulab's groups

    @classmethod
    def detect(cls, fs_root: str | Path = "/sys/fs/cgroup",
               self_cgroup: str | Path = "/proc/self/cgroup") -> tuple[Cgroups | None, str]:
        """(the cgroups to use, "") or (None, why not)."""
        fs_root, self_cgroup = Path(fs_root), Path(self_cgroup)
        if os.geteuid() != 0:
            return None, "the hub does not run as root"
        try:
            own = self_cgroup.read_text().splitlines()
        except OSError as e:
            return None, f"cannot read {self_cgroup}: {e.strerror}"
        controllers = fs_root / "cgroup.controllers"
        if controllers.is_file():
            have = set(controllers.read_text().split())
            if not {"cpu", "memory"} <= have:
                return None, f"the cgroup v2 hierarchy lacks {sorted({'cpu', 'memory'} - have)}"
            found = cls(2, {"cpu": fs_root / "gpulab", "memory": fs_root / "gpulab"})
        else:
            # v1: each controller's hierarchy, where this process's group is
            paths = {}
            for line in own:
                parts = line.split(":", 2)
                if len(parts) == 3:
                    for c in parts[1].split(","):
                        paths[c] = parts[2]
            bases = {}
            for c in ("memory", "cpu"):
                mount = fs_root / c
                if c not in paths or not (mount / "cgroup.procs").exists():
                    return None, f"no cgroup v1 {c} hierarchy at {mount}"
                bases[c] = mount / paths[c].lstrip("/") / "gpulab"
            found = cls(1, bases)
        try:  # a probe: gpulab can make (and remove) its groups here
            found.make("gpulab-probe").remove(kill=False, timeout=0)
        except OSError as e:
            return None, f"cannot make control groups under {found.bases['memory']}: {e.strerror or e}"
        return found, ""

    def _ensure_bases(self) -> None:
        for base in dict.fromkeys(self.bases.values()):
            if self.version == 2:
                _enable(base.parent / "cgroup.subtree_control")
            base.mkdir(exist_ok=True)
            if self.version == 2:
                _enable(base / "cgroup.subtree_control")

    def find(self, unit: str) -> Group:
        """The group of ``unit`` (its folders may be gone already)."""
        name = _UNIT.sub("-", unit).strip("-.") or "unit"
        return Group(name, self.version, {c: base / name for c, base in self.bases.items()})

    def make(self, unit: str, *, memory: int | None = None, cpus: float | None = None) -> Group:
        """A fresh group for ``unit`` with the limits (None: not limited)."""
        group = self.find(unit)
        for attempt in range(3):  # another unit's removal may take gpulab's folder meanwhile
            try:
                self._ensure_bases()
                for d in dict.fromkeys(group.dirs.values()):
                    d.mkdir(exist_ok=True)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        try:
            if self.version == 2:
                d = group.dirs["memory"]
                _write(d / "memory.max", "max" if memory is None else str(memory))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "max" if memory is None else "0")
                _write(d / "cpu.max", "max" if cpus is None
                       else f"{max(1000, int(cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
            else:
                d = group.dirs["memory"]
                limit = "-1" if memory is None else str(memory)
                swap = d / "memory.memsw.limit_in_bytes"
                # memsw may never be below the memory limit: raise it first, lower it last
                if swap.exists():
                    _write(swap, "-1")
                _write(d / "memory.limit_in_bytes", limit)
                if swap.exists() and memory is not None:
                    _write(swap, limit)
                d = group.dirs["cpu"]
                _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(d / "cpu.cfs_quota_us", "-1" if cpus is None
                       else str(max(1000, int(cpus * CPU_PERIOD_US))))
        except OSError:
            group.remove(kill=False, timeout=0)
            raise
        return group


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _enable(subtree_control: Path) -> None:
    have = set(subtree_control.read_text().split())
    missing = [c for c in ("cpu", "memory") if c not in have]
    if missing:
        _write(subtree_control, " ".join(f"+{c}" for c in missing))


_detected: tuple[Cgroups | None, str] | None = None


def local_cgroups() -> tuple[Cgroups | None, str]:
    """`Cgroups.detect` of this machine, once per process (the reason logged once)."""
    global _detected
    if _detected is None:
        _detected = Cgroups.detect()
        if _detected[0] is None:
            log.warning("CPU and memory limits are not enforced: %s", _detected[1])
        else:
            log.info("CPU and memory limits enforced with cgroup v%d under %s",
                     _detected[0].version, ", ".join(sorted({str(b) for b in _detected[0].bases.values()})))
    return _detected
