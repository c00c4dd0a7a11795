"""gpulab as a system service: the systemd unit that runs ``gpulab up`` (``gpulab service``).

`unit_text` builds the unit file from the command line it runs, with no I/O; the CLI
(`gpulab.hub.cli.service`) gathers the flags, writes the file and calls ``systemctl``, as The
Littlest JupyterHub installs its ``jupyterhub.service``.

What the unit says, and why:

- ``Type=exec``, ``Restart=on-failure`` (after ``RestartSec=5s``), ``WantedBy=multi-user.target``
  (started at boot once enabled), after ``network-online.target`` (the hub may listen on a
  public address). stdout and stderr go to the journal (``journalctl -u gpulab``) under the
  name ``gpulab``; the hub also keeps ``<data-dir>/logs/hub.log``.
- ``KillMode=mixed``: ``systemctl stop`` sends SIGTERM to the hub alone, which stops every
  server, the proxy and the gpulab service itself (JupyterHub's ``cleanup_servers``, as on
  Ctrl-C); whatever is still there when the hub has exited, or after ``TimeoutStopSec``, gets
  SIGKILL. With the default (``control-group``) every kernel would get SIGTERM at the same
  time as the hub, before the hub could stop it and give its GPUs back in order. After a
  crash the same SIGKILL ends the servers left behind, and the restarted hub closes their
  GPU allocations: under systemd a crash is a clean restart, not a resume.
- ``Delegate=yes``: on cgroup v2 the service's group is gpulab's to divide; the servers' and
  replicas' groups go inside it (`gpulab.hub.machine.delegation`), so that they are part of the
  service (``systemctl stop`` and ``systemd-cgtop`` see them) rather than at the top of the
  hierarchy, where systemd does not expect anyone.
- ``TasksMax=infinity``: everybody's servers and replicas are processes of this one unit;
  systemd's default (15% of ``pid_max``, counting threads: TensorFlow starts hundreds) would
  be one cap shared by all, which one person could fill for everyone. gpulab bounds each
  server and replica in its own group instead.
- Hardening that keeps root-run spawning working: ``UMask=0077`` (as ``gpulab up`` sets),
  ``RestrictRealtime=yes`` (nobody's process can take a CPU with a real-time priority) and
  a capability bounding set without ``CAP_SYS_BOOT``, ``CAP_SYS_TIME`` and
  ``CAP_WAKE_ALARM`` (nothing gpulab starts reboots the machine or sets its clock, even through
  a setuid program). Nothing that gives the service a mount namespace of its own
  (``ProtectSystem=``, ``ProtectHome=``, ``PrivateTmp=``, ``PrivateDevices=``,
  ``ProtectKernel*=``, ``ProtectControlGroups=``): gpulab makes accounts (``useradd`` writes
  ``/etc``), folders under ``/home`` and the data folder, control groups, and mounts that
  people must see from their own logins too, and servers open ``/dev/nvidia*``; no
  ``NoNewPrivileges=`` either (setuid programs in servers, ``nvidia-modprobe`` among them,
  would stop working), nor a device policy.
"""

from __future__ import annotations

import os
import re

#: the unit's name and where ``gpulab service install`` writes it (below ``--root``)
UNIT_NAME = "gpulab.service"
UNIT_DIR = "/etc/systemd/system"
#: systemd's own search path for a system service's programs, after gpulab's own folders
SYSTEM_PATH = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]

_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


class UnitError(ValueError):
    """A value that cannot be written into a unit file (a control character)."""


def quote(word: str, *, expand_variables: bool = True) -> str:
    """`word` as one word of a unit file's command line (``ExecStart=``) or assignment
    (``Environment=``, `expand_variables` False): double-quoted where it holds anything but
    plain characters, ``%`` written ``%%`` (systemd's specifiers) and, in a command line,
    ``$`` written ``$$`` (its variables)."""
    if any(ord(c) < 32 or ord(c) == 127 for c in word):
        raise UnitError(f"{word!r} holds a control character, which a unit file cannot hold")
    text = word.replace("%", "%%")
    if expand_variables:
        text = text.replace("$", "$$")
    if _PLAIN.fullmatch(word):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def unit_text(*, command: list[str], path: list[str]) -> str:
    """The unit file that runs `command` (``gpulab up`` and its flags; the first word an
    absolute path) as root, with `path` as its ``PATH``."""
    if not command or not command[0].startswith("/"):
        raise UnitError(f"the unit's program must be an absolute path, not {command[:1]}")
    exec_start = " ".join(quote(word) for word in command)
    path_env = quote("PATH=" + os.pathsep.join(path), expand_variables=False)
    return f"""\
# gpulab's hub as a system service, written by `gpulab service install`: run that again with
# other `gpulab up` flags to change it, `gpulab service uninstall` to remove it.
[Unit]
Description=gpulab: a JupyterHub for shared GPUs
Wants=network-online.target
After=network-online.target

[Service]
Type=exec
ExecStart={exec_start}
Environment={path_env}
Environment=PYTHONUNBUFFERED=1
# logs: journalctl -u gpulab (and <data-dir>/logs/hub.log)
StandardOutput=journal
StandardError=journal
SyslogIdentifier=gpulab
Restart=on-failure
RestartSec=5s
# stop: SIGTERM to the hub alone, which stops every server itself; SIGKILL to what is left
KillMode=mixed
TimeoutStopSec=90s
# cgroup v2: servers' and replicas' groups go inside the service's own group
Delegate=yes
# everybody's servers are tasks of this unit: gpulab bounds each one, not all together
TasksMax=infinity
UMask=0077
RestrictRealtime=yes
CapabilityBoundingSet=~CAP_SYS_BOOT CAP_SYS_TIME CAP_WAKE_ALARM

[Install]
WantedBy=multi-user.target
"""


def systemd_running(root: str = "/") -> bool:
    """Whether systemd is this machine's init (sd_booted: ``/run/systemd/system`` exists)."""
    return os.path.isdir(os.path.join(root, "run/systemd/system"))
