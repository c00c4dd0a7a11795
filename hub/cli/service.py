"""``gpulab service``: run the hub as a systemd service (install, uninstall, status).

``gpulab service install [gpulab up flags]`` writes ``/etc/systemd/system/gpulab.service``
(`gpulab.hub.deploy.systemd.unit_text`), which runs this installation's ``gpulab up`` with
those flags, then ``systemctl daemon-reload``, ``enable`` and ``restart`` (or nothing to
restart where it runs already with the same unit): the hub starts at boot, survives the
operator's terminal and comes back after a crash. Root only: the unit runs as root.

Where systemd is not PID 1 (a container, a machine booted otherwise) the unit is written
and nothing else: the command says so and exits 0; ``gpulab up`` by hand works as before.
With ``--root DIR`` the unit goes to ``DIR/etc/systemd/system/`` and systemctl is not called
(an image being built, tests; then root is not needed).

Exit codes: 0 done; 1 systemctl failed (its message is shown); 2 refused (not root, bad
flags, or, where the service would start, a hub already running by hand on the data folder). ``status`` answers as
``systemctl status`` does where systemd runs (0 running, 3 not running, 4 no such unit);
elsewhere 3 when the unit is written, 4 when it is not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpulab.hub.cli.common import fail
from gpulab.hub.cli.up import add_up_arguments, check_up_args, find_proxy
from gpulab.hub.deploy.systemd import (SYSTEM_PATH, UNIT_DIR, UNIT_NAME, UnitError,
                                       systemd_running, unit_text)

EXIT_SYSTEMCTL = 1
#: ``status`` where systemd does not run: as ``systemctl status`` (LSB): not running, unknown
EXIT_NOT_RUNNING, EXIT_NO_UNIT = 3, 4
#: the data folder of a hub run as root, where neither --data-dir nor $GPULAB_DATA_DIR says
ROOT_DATA_DIR = "/var/lib/gpulab"


def add_service_parser(sub) -> None:
    p = sub.add_parser(
        "service", help="run the hub as a systemd service (install, uninstall, status)",
        description="Run `gpulab up` as the systemd service gpulab.service: started at boot, "
        "restarted after a failure, logging to the journal (journalctl -u gpulab).")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    install = actions.add_parser(
        "install", help="write gpulab.service with these `gpulab up` flags, enable and start it",
        description="Write /etc/systemd/system/gpulab.service to run `gpulab up` with the flags "
        "given here (the same as `gpulab up` takes), then enable and (re)start it. As root. "
        "Where systemd is not running, only the file is written.")
    add_up_arguments(install)
    for name, what in (("uninstall", "stop and disable gpulab.service and remove it (the data "
                        "folder stays)"), ("status", "whether gpulab.service is installed and "
                                          "running")):
        actions.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".")
    for q in actions.choices.values():
        q.add_argument("--root", default=None, metavar="DIR",
                       help="work on the unit below DIR (DIR/etc/systemd/system) and never "
                       "call systemctl: for images and tests (then root is not needed)")


def _up_options() -> list[argparse.Action]:
    p = argparse.ArgumentParser(add_help=False)
    add_up_arguments(p)
    return [a for a in p._actions if a.option_strings]


def up_flags(args) -> list[str]:
    """The `gpulab up` flags of `args` that differ from `gpulab up`'s defaults, in the order
    `gpulab up -h` lists them (``--data-dir`` always, as an absolute path: the service must
    not depend on the installer's environment or folder)."""
    out: list[str] = []
    for action in _up_options():
        value = getattr(args, action.dest)
        if action.dest == "data_dir":
            value = os.path.abspath(value or os.environ.get("GPULAB_DATA_DIR") or ROOT_DATA_DIR)
        elif action.dest == "shared_dir" and value is not None:
            value = os.path.abspath(value)
        elif value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:
            if value:
                out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def gpulab_program() -> list[str]:
    """This installation's ``gpulab``: beside the Python that runs it (not resolved through
    links: a virtual environment's Python is one), else that Python with the module."""
    beside = Path(sys.executable).parent / "gpulab"
    if os.access(beside, os.X_OK):
        return [str(beside)]
    return [sys.executable, "-m", "gpulab.hub.cli.main"]


def service_path() -> list[str]:
    """The unit's PATH: this installation's programs (configurable-http-proxy sits beside its
    Python), Node.js's folder (the proxy's interpreter) where it is not a system folder, then
    systemd's own."""
    folders = [str(Path(sys.executable).parent)]
    node = shutil.which("node")
    if node and os.path.dirname(node) not in SYSTEM_PATH:
        folders.append(os.path.dirname(node))
    return list(dict.fromkeys(folders + SYSTEM_PATH))


def _unit_file(root: str | None) -> Path:
    return Path(root or "/") / UNIT_DIR.lstrip("/") / UNIT_NAME


def _systemctl(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemctl", *words], capture_output=True, text=True)


def _refuse_non_root(args) -> int | None:
    if args.root is None and os.geteuid() != 0:
        return fail(f"`gpulab service {args.action}` changes {UNIT_DIR}/{UNIT_NAME} and runs "
                    f"systemctl: run it as root (sudo gpulab service {args.action} ...).")
    return None


def hub_outside_service(data_dir: str) -> int | None:
    """The pid of a hub running on `data_dir` that is not gpulab.service's (None: none)."""
    from gpulab.hub.machine.processes import pid_alive

    try:
        pid = int((Path(data_dir) / "jupyterhub.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    if not pid_alive(pid):
        return None
    try:
        groups = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    return None if f"/{UNIT_NAME}" in groups else pid


def _install(args) -> int:
    problem = check_up_args(args)
    if problem:
        return fail(problem)
    if args.proxy is not None:
        found = find_proxy(args.proxy)
        if found is None:
            return fail(f"--proxy {args.proxy}: no such program.")
        args.proxy = os.path.abspath(found)
    flags = up_flags(args)
    data_dir = flags[flags.index("--data-dir") + 1]
    try:
        text = unit_text(command=[*gpulab_program(), "up", *flags], path=service_path())
    except UnitError as e:
        return fail(str(e))
    path = _unit_file(args.root)
    live = args.root is None and systemd_running()
    if live:  # the service's hub would find the folder taken and fail again and again
        pid = hub_outside_service(data_dir)
        if pid:
            return fail(f"a gpulab hub (pid {pid}) runs on {data_dir} outside the service: "
                        "stop it first (Ctrl-C where it runs), then install the service.")
    try:
        before = path.read_text()
    except OSError:
        before = None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{UNIT_NAME}.{os.getpid()}")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    print(f"gpulab: wrote {path}: gpulab up {' '.join(flags)}")
    if args.root is not None:
        print(f"gpulab: --root: not enabled or started (enable it in that system with "
              f"`systemctl --root={args.root} enable {UNIT_NAME}`)")
        return 0
    if not live:
        print("gpulab: systemd is not running on this machine (it is not PID 1), so "
              f"{UNIT_NAME} was written but not enabled or started. Run `gpulab up` by hand "
              f"here; on a machine booted with systemd, `systemctl enable --now {UNIT_NAME}`.")
        return 0
    active = _systemctl("is-active", "--quiet", UNIT_NAME).returncode == 0
    steps = [("daemon-reload",), ("enable", UNIT_NAME)]
    if before != text or not active:
        steps.append(("restart", UNIT_NAME))
    for step in steps:
        r = _systemctl(*step)
        if r.returncode != 0:
            print(f"gpulab: error: systemctl {' '.join(step)} failed: "
                  f"{(r.stderr or r.stdout).strip()}", file=sys.stderr)
            return EXIT_SYSTEMCTL
    state = "restarted with the new flags" if active and before != text else (
        "already running with these flags" if active else "started")
    print(f"gpulab: {UNIT_NAME} is enabled (starts at boot) and {state}.")
    print(f"gpulab: its log: journalctl -u gpulab -f; the first admin password is in "
          f"{data_dir}/admin_password")
    return 0


def _uninstall(args) -> int:
    path = _unit_file(args.root)
    if args.root is None and systemd_running():
        r = _systemctl("disable", "--now", UNIT_NAME)
        if r.returncode != 0 and path.exists():
            print(f"gpulab: error: systemctl disable --now {UNIT_NAME} failed: "
                  f"{(r.stderr or r.stdout).strip()}", file=sys.stderr)
            return EXIT_SYSTEMCTL
    if not path.exists():
        print(f"gpulab: {path} is not there: nothing to remove.")
        return 0
    path.unlink()
    if args.root is None and systemd_running():
        _systemctl("daemon-reload")
    print(f"gpulab: stopped and removed {path}; the data folder is kept.")
    return 0


def _status(args) -> int:
    path = _unit_file(args.root)
    if args.root is None and systemd_running():
        return subprocess.run(["systemctl", "status", "--no-pager", UNIT_NAME]).returncode
    if not path.exists():
        print(f"gpulab: {UNIT_NAME} is not installed ({path} is not there).")
        return EXIT_NO_UNIT
    command = next((line.partition("=")[2] for line in path.read_text().splitlines()
                    if line.startswith("ExecStart=")), "?")
    why = "--root" if args.root is not None else "systemd is not running on this machine"
    print(f"gpulab: {path} runs: {command}")
    print(f"gpulab: not running as a service ({why}).")
    return EXIT_NOT_RUNNING


def cmd_service(args) -> int:
    if args.action != "status":  # anyone may ask
        refused = _refuse_non_root(args)
        if refused is not None:
            return refused
    return {"install": _install, "uninstall": _uninstall, "status": _status}[args.action](args)
