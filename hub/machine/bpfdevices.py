"""The device allow-list of a cgroup v2 group: a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program.

cgroup v2 has no ``devices.allow`` / ``devices.deny`` files. The kernel instead runs the eBPF
programs attached to a group (and, with ``BPF_F_ALLOW_MULTI``, those of its ancestors too)
whenever a process of the group opens or makes a device node; the access is refused with
``EPERM`` unless every program returns 1. This module builds such a program from an
allow-list, loads it with the ``bpf()`` system call (through ctypes: no compiler, no libbpf)
and attaches it to a group's folder, as runc and systemd do for containers and services.

The allow-list (`allowed_devices`) is what a GPU process needs and no more: the usual
character devices (``/dev/null``, ``zero``, ``full``, ``random``, ``urandom``, ``tty``,
``ptmx`` and the pseudo-terminals ``136:*``, read and write), NVIDIA's shared nodes
(``nvidiactl`` 195:255, ``nvidia-modeset`` 195:254, ``nvidia-uvm`` and ``nvidia-uvm-tools``,
whose major the driver picks at load time: read from ``/proc/devices``) and the unit's own
``/dev/nvidia<minor>`` nodes. Every other device, block or character, is refused, other
people's GPUs included. Making device nodes (``mknod``) is never allowed.

The program (`program`), for the context ``struct bpf_cgroup_dev_ctx { u32 access_type;
u32 major; u32 minor; }`` with the device type in the low 16 bits of ``access_type`` and the
access (mknod 1, read 2, write 4) in the high 16 bits::

    r2 = ctx->access_type & 0xffff        type
    r3 = ctx->access_type >> 16           access
    r4 = ctx->major
    r5 = ctx->minor
    for each rule:                        (a block of 3-5 instructions)
        if r2 != rule.type goto next
        if r3 & ~rule.access goto next    (an access the rule does not grant)
        if r4 != rule.major goto next     (left out for a wildcard major)
        if r5 != rule.minor goto next     (left out for a wildcard minor)
        r0 = 1; exit
    next: ...
    r0 = 0; exit                          refused

Attached with ``BPF_F_ALLOW_MULTI``: the kernel then runs this program in addition to any
program an ancestor carries (systemd's ``DevicePolicy`` on gpulab's own service, a
container's), so gpulab can only narrow what a unit may open, never widen it; and nothing
attached later to the same group (with ``ALLOW_MULTI``, as systemd and runc attach) silently
replaces it. With no flag the program would be the only one allowed in the subtree and a
second attach would replace it. The group holds the program: it goes when the group is
removed, so nothing needs detaching.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: bpf(2) command numbers, program and attach types, flags (linux/bpf.h)
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_QUERY = 16
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 2
#: device types and accesses of struct bpf_cgroup_dev_ctx
DEV_BLOCK, DEV_CHAR = 1, 2
ACC_MKNOD, ACC_READ, ACC_WRITE = 1, 2, 4
RW = ACC_READ | ACC_WRITE

_SYS_BPF = {"x86_64": 321, "aarch64": 280, "arm64": 280, "ppc64le": 361, "s390x": 351,
            "riscv64": 280}
_LICENSE = b"BSD-3-Clause\0"  # a cgroup device program calls no GPL-only helper

NVIDIA_MAJOR = 195
NVIDIA_MODESET_MINOR = 254
NVIDIA_CTL_MINOR = 255

#: the character devices every process may read and write (major, minor; None: any minor)
STANDARD_DEVICES: tuple[tuple[int, int | None], ...] = (
    (1, 3),      # /dev/null
    (1, 5),      # /dev/zero
    (1, 7),      # /dev/full
    (1, 8),      # /dev/random
    (1, 9),      # /dev/urandom
    (5, 0),      # /dev/tty
    (5, 2),      # /dev/ptmx
    (136, None),  # /dev/pts/*: terminals (a notebook's terminal, ssh-like tools)
)


@dataclass(frozen=True)
class Rule:
    """Allow `access` (``ACC_*`` bits) on devices of `type` with `major`/`minor` (None:
    any)."""

    type: int
    major: int | None
    minor: int | None
    access: int = RW


def nvidia_uvm_major(proc_devices: str | Path = "/proc/devices",
                     node: str | Path = "/dev/nvidia-uvm") -> int | None:
    """The character major the ``nvidia-uvm`` driver registered (None: not loaded, and no
    ``/dev/nvidia-uvm`` node says which it will be). The driver is often loaded only when the
    first CUDA program runs: a unit made before then gets no ``nvidia-uvm`` rule, and CUDA
    fails in it, so load it at boot (``nvidia-modprobe -u -c=0``); `Cgroups.make` logs it."""
    try:
        text = Path(proc_devices).read_text()
    except OSError:
        text = ""
    chars = text.split("Block devices:")[0]
    for line in chars.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == "nvidia-uvm" and parts[0].isdigit():
            return int(parts[0])
    try:
        st = os.stat(node)
    except OSError:
        return None
    return os.major(st.st_rdev) if stat.S_ISCHR(st.st_mode) else None


def allowed_devices(gpu_minors: Iterable[int], *,
                    uvm_major: int | None = None) -> list[Rule]:
    """The allow-list of a unit given the GPUs whose ``/dev/nvidia<minor>`` are `gpu_minors`.

    `uvm_major`: the major of ``nvidia-uvm`` (`nvidia_uvm_major`); None where the driver is
    not loaded (then no ``nvidia-uvm`` rule: a major of 0 or a guess would allow some other
    device)."""
    rules = [Rule(DEV_CHAR, major, minor) for major, minor in STANDARD_DEVICES]
    rules += [Rule(DEV_CHAR, NVIDIA_MAJOR, NVIDIA_CTL_MINOR),
              Rule(DEV_CHAR, NVIDIA_MAJOR, NVIDIA_MODESET_MINOR)]
    if uvm_major is not None:
        rules += [Rule(DEV_CHAR, uvm_major, 0),   # /dev/nvidia-uvm
                  Rule(DEV_CHAR, uvm_major, 1)]   # /dev/nvidia-uvm-tools
    for minor in sorted(set(gpu_minors)):
        if not 0 <= minor < NVIDIA_MODESET_MINOR:
            raise ValueError(f"{minor} is not the minor of an NVIDIA GPU node (0-253)")
        rules.append(Rule(DEV_CHAR, NVIDIA_MAJOR, minor))
    return rules


# -- the program -----------------------------------------------------------------------------

# opcodes (class | op | source)
_LDX_W = 0x61        # BPF_LDX | BPF_MEM | BPF_W: dst = *(u32 *)(src + off)
_AND32_K = 0x54      # BPF_ALU | BPF_AND | BPF_K: dst = (u32)(dst & imm)
_RSH32_K = 0x74      # BPF_ALU | BPF_RSH | BPF_K: dst = (u32)dst >> imm
_MOV64_K = 0xb7      # BPF_ALU64 | BPF_MOV | BPF_K: dst = imm
_JNE_K = 0x55        # BPF_JMP | BPF_JNE | BPF_K: if dst != imm: pc += off
_JSET_K = 0x45       # BPF_JMP | BPF_JSET | BPF_K: if dst & imm: pc += off
_EXIT = 0x95         # BPF_JMP | BPF_EXIT: return r0


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One ``struct bpf_insn``: u8 code, u8 dst:4 (low) src:4 (high), s16 off, s32 imm."""
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def program(rules: Iterable[Rule]) -> bytes:
    """The eBPF instructions of a device program allowing exactly `rules` (see the module
    docstring for the layout); everything else is refused."""
    out = [
        _insn(_LDX_W, dst=2, src=1, off=0),   # r2 = access_type
        _insn(_AND32_K, dst=2, imm=0xFFFF),    # r2 = type
        _insn(_LDX_W, dst=3, src=1, off=0),   # r3 = access_type
        _insn(_RSH32_K, dst=3, imm=16),        # r3 = access
        _insn(_LDX_W, dst=4, src=1, off=4),   # r4 = major
        _insn(_LDX_W, dst=5, src=1, off=8),   # r5 = minor
    ]
    for rule in rules:
        if rule.type not in (DEV_BLOCK, DEV_CHAR) or not 0 < rule.access <= 7:
            raise ValueError(f"not a device rule: {rule}")
        # the tests, each jumping past this block (to the next rule) when it fails
        tests: list[tuple[int, int, int]] = [(_JNE_K, 2, rule.type)]
        denied = ~rule.access & 0x7
        if denied:
            tests.append((_JSET_K, 3, denied))
        if rule.major is not None:
            tests.append((_JNE_K, 4, rule.major))
        if rule.minor is not None:
            tests.append((_JNE_K, 5, rule.minor))
        block_len = len(tests) + 2  # the tests, r0 = 1, exit
        for i, (code, reg, imm) in enumerate(tests):
            out.append(_insn(code, dst=reg, off=block_len - 1 - i, imm=imm))
        out += [_insn(_MOV64_K, dst=0, imm=1), _insn(_EXIT)]
    out += [_insn(_MOV64_K, dst=0, imm=0), _insn(_EXIT)]
    return b"".join(out)


# -- the bpf() system call -------------------------------------------------------------------

class BPFError(OSError):
    """The kernel refused a bpf() call (loading, attaching or querying a program)."""


_libc = ctypes.CDLL(None, use_errno=True)


def _bpf(cmd: int, attr: bytes | ctypes.Array) -> int:
    """bpf(cmd, attr): its result, or OSError. `attr` may be a ctypes buffer the kernel
    writes its answer into."""
    number = _SYS_BPF.get(platform.machine())
    if number is None:
        raise BPFError(errno.ENOSYS, f"bpf() is not known on {platform.machine()}")
    buf = attr if isinstance(attr, ctypes.Array) else ctypes.create_string_buffer(attr, len(attr))
    ret = _libc.syscall(ctypes.c_long(number), ctypes.c_int(cmd), buf,
                        ctypes.c_uint(len(attr)))
    if ret < 0:
        e = ctypes.get_errno()
        raise BPFError(e, os.strerror(e))
    return ret


def load(rules: Iterable[Rule]) -> int:
    """Load the device program of `rules` (BPF_PROG_LOAD); its descriptor (close it)."""
    insns = program(rules)
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(_LICENSE, len(_LICENSE))
    log = ctypes.create_string_buffer(4096)
    # union bpf_attr for BPF_PROG_LOAD: u32 prog_type, u32 insn_cnt, u64 insns, u64 license,
    # u32 log_level, u32 log_size, u64 log_buf, u32 kern_version, u32 prog_flags,
    # char prog_name[16], u32 prog_ifindex, u32 expected_attach_type (72 bytes)
    attr = struct.pack("<IIQQIIQII16sII", BPF_PROG_TYPE_CGROUP_DEVICE, len(insns) // 8,
                       ctypes.addressof(code), ctypes.addressof(lic), 0, 0, 0, 0, 0,
                       b"gpulab_devices", 0, BPF_CGROUP_DEVICE)
    try:
        return _bpf(BPF_PROG_LOAD, attr)
    except BPFError as e:
        if e.errno not in (errno.EINVAL, errno.EACCES):
            raise
    # the verifier refused it: once more with its log, for the message
    attr = struct.pack("<IIQQIIQII16sII", BPF_PROG_TYPE_CGROUP_DEVICE, len(insns) // 8,
                       ctypes.addressof(code), ctypes.addressof(lic), 1, len(log),
                       ctypes.addressof(log), 0, 0, b"gpulab_devices", 0, BPF_CGROUP_DEVICE)
    try:
        return _bpf(BPF_PROG_LOAD, attr)
    except BPFError as e:
        raise BPFError(e.errno, f"the kernel refused gpulab's device program: "
                      f"{log.value.decode(errors='replace')[-500:] or e.strerror}") from e


def attach(group_dir: str | Path, rules: Iterable[Rule]) -> None:
    """Attach the device program of `rules` to the cgroup v2 group at `group_dir`
    (BPF_PROG_ATTACH, BPF_CGROUP_DEVICE, BPF_F_ALLOW_MULTI: see the module docstring)."""
    prog = load(rules)
    try:
        group = os.open(group_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            # struct: u32 target_fd, u32 attach_bpf_fd, u32 attach_type, u32 attach_flags,
            # u32 replace_bpf_fd
            _bpf(BPF_PROG_ATTACH, struct.pack("<IIIII", group, prog, BPF_CGROUP_DEVICE,
                                              BPF_F_ALLOW_MULTI, 0))
        finally:
            os.close(group)
    finally:
        os.close(prog)  # the group holds the program now


def attached(group_dir: str | Path) -> int:
    """How many device programs are attached to the group itself (BPF_PROG_QUERY)."""
    group = os.open(group_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ids = (ctypes.c_uint32 * 64)()
        # u32 target_fd, u32 attach_type, u32 query_flags, u32 attach_flags, u64 prog_ids,
        # u32 prog_cnt
        attr = struct.pack("<IIIIQII", group, BPF_CGROUP_DEVICE, 0, 0,
                           ctypes.addressof(ids), len(ids), 0)
        buf = ctypes.create_string_buffer(attr, len(attr))
        _bpf(BPF_PROG_QUERY, buf)
        return struct.unpack_from("<I", buf.raw, 24)[0]
    finally:
        os.close(group)


def check() -> str:
    """'' where this kernel loads device programs for this process, else why not (a probe
    that loads the smallest program and closes it)."""
    try:
        os.close(load([]))
    except BPFError as e:
        return f"the kernel refused a BPF device program: {e.strerror or e}"
    return ""
