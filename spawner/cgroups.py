"""Control groups for local notebook servers and training replicas: limits, GPUs, clean stop.

Every server and every replica runs in a control group of its own, made by gpulab, limits or
not, so that (1) a profile's ``cpu_limit`` / ``mem_limit`` and a job role's ``cpu`` /
``memory`` are enforced by the kernel, and so is a bound on its processes and threads
(``pids``: a fork bomb stops at its own group's bound, not at the machine's ``pid_max``),
(2) the process may open only the NVIDIA device nodes of the GPUs it was given (a device
allow-list: ``CUDA_VISIBLE_DEVICES`` alone is advice, not a boundary), and (3) stop ends
everything the process started, ``setsid`` grandchildren too.

- **cgroup v2** (the unified hierarchy, ``/sys/fs/cgroup/cgroup.controllers`` lists ``cpu`` and
  ``memory``): groups ``/sys/fs/cgroup/gpulab/<unit>`` with ``memory.max``, ``memory.swap.max``
  = 0, ``cpu.max`` and ``pids.max`` (each written only when that limit is set: a fresh group
  is unlimited). ``gpulab`` sits at the top of the hierarchy because a group that holds
  processes (the hub's own) may not hand controllers down to child groups; run by systemd
  with ``Delegate=yes`` (``gpulab service install``), ``gpulab`` sits inside the service's own
  group instead, beside the hub's leaf (`gpulab.spawner.delegation`). It hands down ``cpu``,
  ``memory`` and ``pids`` where the hierarchy offers them. The v2 hierarchy has no
  device files: gpulab attaches a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program to every group given
  a GPU list (`gpulab.spawner.bpfdevices`: the usual character devices, NVIDIA's shared nodes
  and the unit's own GPUs; everything else refused). Stop writes ``cgroup.kill``; on kernels
  before 5.14, which lack it, it freezes the group (``cgroup.freeze``), kills every process in
  it and thaws it, as on v1.
- **cgroup v1** (``memory`` and ``cpu`` hierarchies, and ``pids``, ``devices`` and ``freezer``
  where mounted): groups ``<hierarchy>/<the hub's group>/gpulab/<unit>`` with
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is accounted),
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, ``pids.max``, and ``devices.deny`` entries
  for every NVIDIA GPU device node (major 195) except the group's own GPUs; ``nvidiactl``
  (195:255) and ``nvidia-uvm`` (a major of its own) stay usable. Groups are nested under the
  hub's own group so that whatever already limits the hub keeps limiting what it starts.
  Stop freezes the group (``freezer.state``), kills every process in it and thaws it: nothing
  can fork its way out between reading the list and the kill.

The child process joins its group in ``preexec_fn`` (as root, before it drops to the user's
account), so everything it starts is inside too, and an ordinary account can never move a
process out (the hierarchy's files belong to root). Making groups needs root and a writable
hierarchy: without them nothing here is enforced, and `detect` says why (the hub logs it once).
A process killed by the memory limit is told apart by `Group.oom_kills`; forks refused by
the process bound are counted by `Group.pids_refused`.

Where no groups can be made, `limit_user_processes` (``RLIMIT_NPROC``, set in the same
``preexec_fn``) is the second line against a fork bomb: it bounds all processes of the
person's account together, below the machine's ``pid_max``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import resource
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from . import bpfdevices

log = logging.getLogger("gpulab.cgroups")

#: the CPU bandwidth period written with a CPU limit (microseconds; the kernel's default)
CPU_PERIOD_US = 100_000
#: the character-device major of NVIDIA's GPU nodes (/dev/nvidia<minor>, /dev/nvidiactl)
NVIDIA_MAJOR = 195
#: /dev/nvidiactl, which every CUDA process opens: always allowed
NVIDIA_CTL_MINOR = 255
#: the minors denied to a group with a GPU list (all but nvidiactl; 254 is nvidia-modeset,
#: display only, which compute never needs)
NVIDIA_GPU_MINORS = range(0, NVIDIA_CTL_MINOR)
_UNIT = re.compile(r"[^A-Za-z0-9_.-]+")
_V1_OPTIONAL = ("pids", "devices", "freezer")
#: the v2 controllers gpulab's folder hands down to its groups (pids only where offered)
_V2_CONTROLLERS = ("cpu", "memory", "pids")

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


def default_pids(floor: int, per_cpu: int) -> int:
    """A default process bound for one unit: `floor`, or `per_cpu` per CPU of this machine
    where that is more (TensorFlow starts about two threads per CPU in each process, and the
    bound counts threads: a 2-CPU machine's training process has 9)."""
    return max(floor, per_cpu * (os.cpu_count() or 1))


def default_user_processes(pid_max: str | Path = "/proc/sys/kernel/pid_max",
                           threads_max: str | Path = "/proc/sys/kernel/threads-max") -> int:
    """The default bound on one person's processes and threads together (``RLIMIT_NPROC``):
    a quarter of what the kernel can hold (the smaller of ``pid_max`` and ``threads-max``;
    8,192 of 32,768 here), so that one person's fork bomb leaves most process numbers to
    everyone else and to the hub, at least 1,024."""
    sizes = []
    for f in (pid_max, threads_max):
        try:
            sizes.append(int(Path(f).read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    return max(1024, min(sizes or [32768]) // 4)


def limit_user_processes(n: int | None) -> None:
    """Bound the processes (and threads) of the account this process is about to become to
    `n` (``RLIMIT_NPROC``, soft and hard; None or 0: left as it is). The kernel counts all
    processes of the account, in any group, against it at every fork. Call in
    ``preexec_fn`` before dropping privileges; it only ever lowers the bound."""
    if not n:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    cap = n if hard == resource.RLIM_INFINITY else min(n, hard)
    resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))


def device_denials(allowed_minors: Iterable[int]) -> list[str]:
    """The v1 ``devices.deny`` lines that leave a group only the GPUs of `allowed_minors`.

    A v1 group inherits "everything allowed" from gpulab's parent group; there, writing an
    allow entry only removes an identical deny entry, so the other GPUs are denied one by one
    rather than with ``c 195:* rwm`` and exceptions.
    """
    keep = set(allowed_minors)
    return [f"c {NVIDIA_MAJOR}:{m} rwm" for m in NVIDIA_GPU_MINORS if m not in keep]


@dataclass
class Group:
    """One unit's control group (one folder per hierarchy under v1, one under v2)."""

    unit: str
    version: int
    # controller ("memory", "cpu", v1 also "devices", "freezer") -> folder
    dirs: dict[str, Path] = field(default_factory=dict)

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in dict.fromkeys(self.dirs.values())]

    def exists(self) -> bool:
        return any(d.is_dir() for d in self.dirs.values())

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

    def pids_refused(self) -> int:
        """How many forks (or new threads) the group's process bound refused."""
        d = self.dirs.get("pids")
        try:
            for line in (d / "pids.events").read_text().splitlines() if d else ():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def kill(self, *, use_kill_file: bool = True) -> None:
        """SIGKILL every process in the group, without a window for a fork to escape:
        ``cgroup.kill`` on v2 (kernel 5.14+; ``use_kill_file=False`` skips it, as a kernel
        without it would); otherwise freeze, kill, thaw (v2 ``cgroup.freeze``, v1
        ``freezer.state``), or, with no freezer either, kill what is listed, which `remove`
        repeats until the group is empty."""
        if self.version == 2:
            d = next(iter(self.dirs.values()), None)
            if d is None or not d.is_dir():
                return
            if use_kill_file and (d / "cgroup.kill").exists():
                try:
                    _write(d / "cgroup.kill", "1")
                except FileNotFoundError:
                    pass
                return
            if (d / "cgroup.freeze").exists():
                self._frozen_kill(d / "cgroup.freeze", "1", "0",
                                  lambda: _events(d).get("frozen") == "1")
            else:
                self._signal_all()
            return
        freezer = self.dirs.get("freezer")
        if freezer is None or not freezer.is_dir():
            self._signal_all()
            return
        state = freezer / "freezer.state"
        self._frozen_kill(state, "FROZEN", "THAWED",
                          lambda: state.read_text().strip() == "FROZEN")

    def _frozen_kill(self, control: Path, freeze: str, thaw: str,
                     frozen: Callable[[], bool]) -> None:
        try:
            _write(control, freeze)
            deadline = time.monotonic() + 1.0
            # freezing until every task stopped (one in uninterruptible sleep may hold it)
            while not frozen() and time.monotonic() < deadline:
                time.sleep(0.005)
            self._signal_all()  # a frozen task dies as soon as it thaws
        except FileNotFoundError:
            return
        finally:
            try:
                _write(control, thaw)
            except OSError:
                pass

    def _signal_all(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, kill: bool = True, timeout: float = 5.0) -> bool:
        """Remove the group, first killing everything in it (``kill``); False if it could
        not be removed within `timeout` seconds (processes still there)."""
        deadline = time.monotonic() + timeout
        while True:
            if kill and self.pids():
                self.kill()
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
                log.warning("Control group %s still holds processes %s", self.unit, self.pids())
                return False
            time.sleep(0.02)


def _gpu_minor(index: int) -> int:
    from .inventory import gpu_minor

    return gpu_minor(index)


@dataclass
class Cgroups:
    """Where gpulab makes its groups: `detect` finds it, `make` makes one unit's group."""

    version: int
    bases: dict[str, Path]  # controller -> the folder holding gpulab's groups
    #: a GPU's index -> the minor number of its /dev/nvidia<minor> node
    gpu_minor: Callable[[int], int] = field(default=_gpu_minor, repr=False)
    #: v2: why this kernel refuses device programs ('' where it loads them; None: not
    #: checked yet, `bpfdevices.check` runs on first use)
    bpf_problem: str | None = field(default=None, repr=False)

    @property
    def devices_enforced(self) -> bool:
        """Whether `make(gpus=...)` restricts device nodes in the kernel here."""
        if self.version == 2:
            if self.bpf_problem is None:
                self.bpf_problem = bpfdevices.check()
            return not self.bpf_problem
        return "devices" in self.bases

    @property
    def devices_why(self) -> str:
        """Why GPU device nodes are not restricted here ('' when they are)."""
        if self.devices_enforced:
            return ""
        if self.version == 2:
            return ("cgroup v2 restricts devices only through a BPF device program, and "
                    f"{self.bpf_problem}: any local process may open any GPU")
        return "there is no cgroup v1 devices hierarchy: any local process may open any GPU"

    @property
    def pids_enforced(self) -> bool:
        """Whether `make(pids=...)` bounds a group's processes here."""
        return "pids" in self.bases

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
            # under systemd with Delegate=yes, inside the service's own group
            from .delegation import delegated_top

            top = delegated_top(fs_root, self_cgroup) or fs_root
            found = cls(2, {c: top / "gpulab" for c in _V2_CONTROLLERS if c in have})
        else:
            # v1: each controller's hierarchy, where this process's group is
            paths = {}
            for line in own:
                parts = line.split(":", 2)
                if len(parts) == 3:
                    for c in parts[1].split(","):
                        paths[c] = parts[2]
            bases = {}
            for c in ("memory", "cpu") + _V1_OPTIONAL:
                mount = fs_root / c
                if c not in paths or not (mount / "cgroup.procs").exists():
                    if c in _V1_OPTIONAL:
                        continue
                    return None, f"no cgroup v1 {c} hierarchy at {mount}"
                bases[c] = mount / paths[c].lstrip("/") / "gpulab"
            found = cls(1, bases)
        probe = f"gpulab-probe-{os.getpid()}"
        try:  # a probe: gpulab can make (and remove) its groups here, with a device program
            try:
                found.make(probe, gpus=[]).remove(kill=False, timeout=0)
            except bpfdevices.BPFError as e:  # loaded, but not attached to a group here
                found.find(probe).remove(kill=False, timeout=0)
                found.bpf_problem = ("the kernel refused to attach a BPF device program to "
                                     f"a group: {e.strerror or e}")
                found.make(probe).remove(kill=False, timeout=0)
        except OSError as e:
            return None, f"cannot make control groups under {found.bases['memory']}: {e.strerror or e}"
        return found, ""

    def _ensure_bases(self) -> None:
        wanted = [c for c in _V2_CONTROLLERS if c in self.bases]
        for base in dict.fromkeys(self.bases.values()):
            if self.version == 2:
                _enable(base.parent, wanted)
            base.mkdir(exist_ok=True)
            if self.version == 2:
                _enable(base, wanted)

    def find(self, unit: str) -> Group:
        """The group of ``unit`` (its folders may be gone already)."""
        name = _UNIT.sub("-", unit).strip("-.") or "unit"
        return Group(name, self.version, {c: base / name for c, base in self.bases.items()})

    def make(self, unit: str, *, memory: int | None = None, cpus: float | None = None,
             pids: int | None = None, gpus: Iterable[int] | None = None) -> Group:
        """A fresh group for ``unit`` with the limits (None: not limited).

        ``pids``: the most processes and threads the group may hold together (where
        `pids_enforced`). ``gpus``: None leaves devices alone; a list of GPU indexes
        (possibly empty) lets the group open only those GPUs' device nodes (where
        `devices_enforced`; elsewhere nothing is restricted and `devices_why` says so): on
        v1 by ``devices.deny`` entries for the other GPUs, on v2 by a device program that
        allows only what `bpfdevices.allowed_devices` lists. The group must not exist yet
        (`FileExistsError`): a unit's limits are written once, when it is made, and never
        onto a group someone else is using. Remove a unit's stale group first.
        """
        group = self.find(unit)
        made: list[Path] = []
        for attempt in range(3):  # another unit's removal may take gpulab's folder meanwhile
            try:
                self._ensure_bases()
                for d in dict.fromkeys(group.dirs.values()):
                    if d not in made:
                        d.mkdir()
                        made.append(d)
                break
            except FileExistsError:
                for d in made:
                    d.rmdir()
                raise
            except FileNotFoundError:
                if attempt == 2:
                    for d in made:
                        d.rmdir()
                    raise
        try:
            self._set_limits(group, memory, cpus)
            if pids is not None and "pids" in group.dirs:
                _write(group.dirs["pids"] / "pids.max", str(pids))
            if gpus is not None and self.devices_enforced:
                minors = [self.gpu_minor(i) for i in gpus]
                if self.version == 2:  # before any process joins: nothing opens unchecked
                    uvm = bpfdevices.nvidia_uvm_major()
                    if uvm is None and minors and os.path.exists("/dev/nvidiactl"):
                        log.warning("nvidia-uvm is not loaded: CUDA will fail in %s (load it "
                                    "at boot: nvidia-modprobe -u -c=0)", unit)
                    allowed = bpfdevices.allowed_devices(minors, uvm_major=uvm)
                    bpfdevices.attach(next(iter(group.dirs.values())), allowed)
                else:
                    d = group.dirs["devices"]
                    for line in device_denials(minors):
                        _write(d / "devices.deny", line)
        except OSError:
            group.remove(kill=False, timeout=0)
            raise
        return group

    def _set_limits(self, group: Group, memory: int | None, cpus: float | None) -> None:
        if self.version == 2:
            # a fresh group is unlimited: only a limit that is set is written (a file of a
            # controller the hierarchy does not offer is absent, and then a limit is an error)
            d = next(iter(group.dirs.values()))
            if memory is not None:
                _write(d / "memory.max", str(memory))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
            if cpus is not None:
                _write(d / "cpu.max", f"{max(1000, int(cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
            return
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


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _enable(folder: Path, controllers: Iterable[str]) -> None:
    """Hand `controllers` down to the v2 groups below `folder` (those it offers and has not
    handed down yet; a limit of one it does not offer then fails when written)."""
    listed = folder / "cgroup.controllers"  # (the kernel always shows it; a stand-in may not)
    offered = set(listed.read_text().split()) if listed.exists() else set(controllers)
    have = set((folder / "cgroup.subtree_control").read_text().split())
    missing = [c for c in controllers if c in offered and c not in have]
    if missing:
        _write(folder / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))


def _events(folder: Path) -> dict[str, str]:
    """A v2 group's ``cgroup.events`` (``populated``, ``frozen``)."""
    try:
        lines = (folder / "cgroup.events").read_text().splitlines()
        return dict(line.split(" ", 1) for line in lines)
    except (OSError, ValueError):
        return {}


_detected: tuple[Cgroups | None, str] | None = None


def local_cgroups() -> tuple[Cgroups | None, str]:
    """`Cgroups.detect` of this machine, once per process (the reason logged once)."""
    global _detected
    if _detected is None:
        _detected = Cgroups.detect()
        found, why = _detected
        if found is None:
            log.warning("Control groups are not used (no CPU, memory or GPU device limits, "
                        "stop cannot end everything a server started): %s", why)
        else:
            log.info("Control groups v%d under %s", found.version,
                     ", ".join(sorted({str(b) for b in found.bases.values()})))
            if not found.devices_enforced:
                log.warning("GPU device nodes are not restricted: %s", found.devices_why)
            if not found.pids_enforced:
                log.warning("Processes per server and replica are not bounded (no pids "
                            "controller here); only each account's RLIMIT_NPROC bounds them")
    return _detected
