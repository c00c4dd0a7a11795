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
  group instead, beside the hub's leaf (`gpulab.hub.machine.delegation`). It hands down ``cpu``,
  ``memory`` and ``pids`` where the hierarchy offers them. The v2 hierarchy has no
  device files: gpulab attaches a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program to every group given
  a GPU list (`gpulab.hub.machine.bpfdevices`: the usual character devices, NVIDIA's shared nodes
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

**gpulab's folder weighs as many threads as the machine has CPUs** (`_weigh_base`: v1
``cpu.shares`` 1024 × CPUs, v2 ``cpu.weight`` 100 × CPUs, where it still has the kernel's
default): with the default it would weigh one busy thread, and people's work together would
get no more CPU time than any single thread of the processes beside it.

**One person as a whole.** Every unit of one person (their servers and training replicas)
nests in a group of that person, ``gpulab/person-<hub>-<name>/<unit>`` (`person_unit`; v1 in
every hierarchy, v2 once), with a memory and CPU limit of its own (`Cgroups.make`'s
``person_memory`` / ``person_cpus``: ``c.LocalGPUSpawner.person_mem_limit`` /
``person_cpu_limit``, by default half the machine's memory and three quarters of its CPUs,
`share_of_memory` / `share_of_cpus`): many servers and replicas, each within its own limit,
cannot together take the machine. It is made when the person's first unit starts
(create-if-missing, its limits written to the value asked whenever they differ) and removed
with their last (remove-if-empty: a unit starting meanwhile keeps it, or makes it again). On
v1 the parent's memory limit bounds its children only with ``memory.use_hierarchy`` = 1
(always so on kernels since 5.x; gpulab sets it on a fresh person group, and warns where it
cannot), and a child's CPU quota may not exceed its parent's there, so a unit's CPU limit is
at most its person's.

The kernel's OOM killer picks people's work first: servers and replicas start with
``oom_score_adj`` 500 (`set_oom_score_adj`, in ``preexec_fn`` as root, so their account
cannot lower it again), the hub, its proxy and the gpulab service with -900.

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

#: the CPU weight of one busy thread at nice 0 (v1 ``cpu.shares``, v2 ``cpu.weight``: the
#: kernel's default of a group) and the most a group may have
_ONE_THREAD_WEIGHT = {1: 1024, 2: 100}
_MAX_WEIGHT = {1: 262144, 2: 10000}

#: the name of every person-level group starts with this (`person_unit`)
PERSON_PREFIX = "person-"

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


def machine_memory(meminfo: str | Path = "/proc/meminfo") -> int:
    """This machine's memory in bytes (``MemTotal``; the pages the kernel reports where
    /proc/meminfo cannot be read)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or a cpuset's share)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def share_of_memory(fraction: float, total: int | None = None) -> int:
    """`fraction` of `total` bytes (default: this machine's memory), whole MiB, at least
    64 MiB."""
    total = machine_memory() if total is None else total
    return max(64 * 2**20, int(total * fraction) // 2**20 * 2**20)


def share_of_cpus(fraction: float, cpus: int | None = None) -> float:
    """`fraction` of `cpus` (default: this machine's), in hundredths, at least one CPU."""
    cpus = machine_cpus() if cpus is None else cpus
    return max(1.0, round(cpus * fraction, 2))


def person_unit(hub_tag: str, user: str) -> str:
    """The person-level group of hub user `user` on the hub tagged `hub_tag`:
    ``person-<hub_tag>-<name>``, the name as `gpulab.hub.machine.accounts.safe_slug` keeps or
    escapes it (one-to-one, at most 48 characters), so that the hub's servers (which know the
    user's name) and the service's replicas (which know it too, not the hub's user id) name
    the same group, and hubs sharing the machine never share one."""
    from .accounts import safe_slug

    return f"{PERSON_PREFIX}{hub_tag}-{safe_slug(user, 48)}"


def set_oom_score_adj(value: int | None, pid: int | str = "self") -> bool:
    """Write `value` to ``/proc/<pid>/oom_score_adj`` (-1000..1000; None: left as it is);
    False where the kernel refused it. As root (``CAP_SYS_RESOURCE``) it also becomes the
    lowest value the process and its children may set again without that capability: a
    server given 500 in ``preexec_fn`` cannot lower it once it runs as its person."""
    if value is None:
        return True
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(max(-1000, min(1000, int(value)))))
        return True
    except OSError:
        return False


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
                # the person's group goes too once empty (their last unit ended), and so
                # does gpulab's folder: nothing of gpulab is left in the hierarchy (the next
                # `make` makes them again; one that holds another unit is busy and stays)
                for d in dict.fromkeys(d.parent for d in self.dirs.values()):
                    for folder in ((d, d.parent) if d.name.startswith(PERSON_PREFIX) else (d,)):
                        try:
                            folder.rmdir()
                        except OSError:
                            break
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

    def _ensure_bases(self, person: str | None = None, memory: int | None = None,
                      cpus: float | None = None) -> None:
        """gpulab's folder, and the group of `person` with its limits, made if missing."""
        wanted = [c for c in _V2_CONTROLLERS if c in self.bases]
        for base in dict.fromkeys(self.bases.values()):
            if self.version == 2:
                _enable(base.parent, wanted)
            _mkdir(base)
            if self.version == 2:
                _enable(base, wanted)
        if "cpu" in self.bases:
            _weigh_base(self.version, self.bases["cpu"])
        if person is None:
            return
        name = _safe(person)
        for base in dict.fromkeys(self.bases.values()):
            _mkdir(base / name)
            if self.version == 2:
                _enable(base / name, wanted)
        dirs = {c: base / name for c, base in self.bases.items()}
        if self.version == 1:
            _use_hierarchy(dirs["memory"])
        _set_person_limits(self.version, dirs, memory, cpus)

    def find(self, unit: str, person: str | None = None) -> Group:
        """The group of ``unit`` in the person-level group `person` (its folders may be
        gone already). Without `person`: where the unit's group is, in whichever person's
        group (unit names are unique on the machine) or directly in gpulab's folder (as
        gpulab made them before person-level groups); gpulab's folder when it is nowhere."""
        name = _safe(unit)
        if person is not None:
            where = _safe(person)
            return Group(name, self.version,
                         {c: base / where / name for c, base in self.bases.items()})
        dirs = {}
        for c, base in self.bases.items():
            found = base / name
            if not found.is_dir():
                try:
                    people = sorted(base.glob(PERSON_PREFIX + "*"))
                except OSError:
                    people = []
                found = next((d / name for d in people if (d / name).is_dir()), found)
            dirs[c] = found
        return Group(name, self.version, dirs)

    def make(self, unit: str, *, memory: int | None = None, cpus: float | None = None,
             pids: int | None = None, gpus: Iterable[int] | None = None,
             person: str | None = None, person_memory: int | None = None,
             person_cpus: float | None = None) -> Group:
        """A fresh group for ``unit`` with the limits (None: not limited), inside the
        person-level group `person` (`person_unit`; None: directly in gpulab's folder).

        `person_memory` / `person_cpus`: the limits of all of that person's units together,
        written on the person's group (made if missing) whenever they differ from what it
        has; a limit that cannot be lowered now (v1: more memory in use, or units with a
        larger CPU quota) stays as it was and is logged. On v1 the unit's CPU limit is at
        most `person_cpus` (the kernel refuses a child's quota above its parent's).

        ``pids``: the most processes and threads the group may hold together (where
        `pids_enforced`). ``gpus``: None leaves devices alone; a list of GPU indexes
        (possibly empty) lets the group open only those GPUs' device nodes (where
        `devices_enforced`; elsewhere nothing is restricted and `devices_why` says so): on
        v1 by ``devices.deny`` entries for the other GPUs, on v2 by a device program that
        allows only what `bpfdevices.allowed_devices` lists. The group must not exist yet
        (`FileExistsError`): a unit's limits are written once, when it is made, and never
        onto a group someone else is using. Remove a unit's stale group first.
        """
        group = self.find(unit, person)
        if person is not None and cpus is not None and person_cpus is not None:
            cpus = min(cpus, person_cpus)
        made: list[Path] = []
        # another unit's removal may take the person's group or gpulab's folder meanwhile
        # (ENOENT, or ENODEV in a group being removed): made again, up to ten times
        for attempt in range(10):
            try:
                self._ensure_bases(person, person_memory, person_cpus)
                for d in dict.fromkeys(group.dirs.values()):
                    if d not in made:
                        d.mkdir()
                        made.append(d)
                break
            except FileExistsError:
                for d in made:
                    d.rmdir()
                raise
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENODEV) or attempt == 9:
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


def _mkdir(folder: Path) -> None:
    """`folder`, made if missing (one that another unit's removal takes right after is
    ENOENT at the next step, which `Cgroups.make` retries; ``Path.mkdir(exist_ok=True)``
    would say FileExistsError then)."""
    try:
        os.mkdir(folder)
    except FileExistsError:
        pass


def _safe(unit: str) -> str:
    """A unit's (or person's) name as one folder name: it cannot leave gpulab's folder."""
    return _UNIT.sub("-", unit).strip("-.") or "unit"


#: v1 reads an unlimited memory limit back as the largest page count (about 2**63)
_V1_UNLIMITED = 2**62


def _page_floor(n: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    return n // page * page


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:  # a fresh stand-in folder (the kernel always shows them)
        return None


def _update(path: Path, want: str, unlimited: str) -> None:
    """Write `want` where the file holds another value (a missing file, a fresh stand-in's,
    holds `unlimited`)."""
    now = _read(path)
    if (unlimited if now is None else now) != want:
        _write(path, want)


def _use_hierarchy(memory_dir: Path) -> None:
    """v1: a person's memory limit bounds the units below it only with
    ``memory.use_hierarchy`` 1 (always 1 on kernels since 5.x; set on a group without
    children on older ones)."""
    f = memory_dir / "memory.use_hierarchy"
    if _read(f) != "0":
        return
    try:
        _write(f, "1")
    except OSError as e:
        log.warning("memory.use_hierarchy of %s is 0 and cannot be set (%s): the person's "
                    "memory limit does not bound their servers and replicas", memory_dir,
                    e.strerror)


def _set_person_limits(version: int, dirs: dict[str, Path], memory: int | None,
                       cpus: float | None) -> None:
    """Write a person-level group's memory and CPU limit (None: unlimited) where it has
    another; one the kernel refuses to lower now (EBUSY, EINVAL) is logged and left as it
    is, the other written all the same."""
    memory = None if memory is None else _page_floor(memory)
    quota = None if cpus is None else max(1000, int(cpus * CPU_PERIOD_US))
    d, c = dirs["memory"], dirs["cpu"]

    def v2_memory():
        _update(d / "memory.max", "max" if memory is None else str(memory), "max")
        if memory is not None and (d / "memory.swap.max").exists():
            _update(d / "memory.swap.max", "0", "")

    def v2_cpu():
        _update(c / "cpu.max", f"{'max' if quota is None else quota} {CPU_PERIOD_US}",
                f"max {CPU_PERIOD_US}")

    def v1_memory():
        now = _read(d / "memory.limit_in_bytes")
        if (None if now is None or int(now) >= _V1_UNLIMITED else int(now)) == memory:
            return
        swap = d / "memory.memsw.limit_in_bytes"
        try:  # memsw may never be below the memory limit: raised first, lowered last
            if swap.exists():
                _write(swap, "-1")
            _write(d / "memory.limit_in_bytes", "-1" if memory is None else str(memory))
        finally:
            limit = _read(d / "memory.limit_in_bytes")
            if swap.exists() and limit is not None and int(limit) < _V1_UNLIMITED:
                _write(swap, limit)

    def v1_cpu():
        _update(c / "cpu.cfs_period_us", str(CPU_PERIOD_US), str(CPU_PERIOD_US))
        _update(c / "cpu.cfs_quota_us", "-1" if quota is None else str(quota), "-1")

    for what, write in (("memory", v2_memory if version == 2 else v1_memory),
                        ("CPU", v2_cpu if version == 2 else v1_cpu)):
        try:
            write()
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.EINVAL):
                raise
            log.warning("The %s limit of %s stays as it was (%s asked): %s", what, d.name,
                        memory if what == "memory" else cpus, e.strerror)


def _weigh_base(version: int, base: Path) -> None:
    """gpulab's folder weighs, against the processes and groups beside it, as much as as
    many busy threads as the machine has CPUs (``cpu.shares`` 1024 × CPUs on v1,
    ``cpu.weight`` 100 × CPUs on v2), where it still has the kernel's default, one thread's
    (a value the operator wrote stays). With one thread's weight, all people's work together
    would get, when the CPUs are contended, as much as one busy thread of any process in
    the hub's group (the root group where the hub runs outside systemd): a training job of
    four replicas had 0.9 CPUs where the same processes started by hand had 1.2 (issue 34).
    The hub's own processes beside it still get nearly one CPU when people's work fills the
    machine."""
    f = base / ("cpu.shares" if version == 1 else "cpu.weight")
    one = _ONE_THREAD_WEIGHT[version]
    if _read(f) != str(one):  # missing (a stand-in's, or no cpu controller), or the operator's
        return
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    want = min(_MAX_WEIGHT[version], one * cpus)
    if want != one:
        try:
            _write(f, str(want))
        except OSError as e:
            log.warning("Could not give %s the CPU weight of %d threads: %s", base, cpus, e)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _enable(folder: Path, controllers: Iterable[str]) -> None:
    """Hand `controllers` down to the v2 groups below `folder` (those it offers and has not
    handed down yet; a limit of one it does not offer then fails when written)."""
    listed = folder / "cgroup.controllers"  # (the kernel always shows it; a stand-in may not)
    offered = set(listed.read_text().split()) if listed.exists() else set(controllers)
    have = set((_read(folder / "cgroup.subtree_control") or "").split())
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
