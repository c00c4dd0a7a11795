"""``gpulab up``: the local deployment.

It runs JupyterHub with configurable-http-proxy, GPU-bound
notebook servers, accounts in the hub, everything kept in one data folder.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from gpulab.hub.machine.processes import pid_alive

from gpulab.hub.cli.common import fail
from gpulab.hub.deploy.datadir import DataDir, DataDirError


def default_data_dir() -> str:
    if os.environ.get("GPULAB_DATA_DIR"):
        return os.environ["GPULAB_DATA_DIR"]
    if os.geteuid() == 0:
        return "/var/lib/gpulab"
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(base, "gpulab")


def find_proxy(explicit: str | None) -> str | None:
    """configurable-http-proxy: --proxy, else beside this Python (where set-up puts it), else PATH."""
    if explicit:
        return shutil.which(explicit) or (explicit if os.access(explicit, os.X_OK) else None)
    here = os.path.dirname(sys.executable)
    return shutil.which("configurable-http-proxy", path=here + os.pathsep + os.environ.get("PATH", ""))


def port_in_use(ip: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _pid_from(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def add_up_parser(sub) -> None:
    p = sub.add_parser(
        "up",
        help="run the local deployment (JupyterHub on this machine)",
        description="Run JupyterHub with GPU-bound notebook servers on this machine. "
        "Ctrl-C stops the hub and every server it started; running it again on the same "
        "data folder resumes where it stopped.",
    )
    add_up_arguments(p)


def add_up_arguments(p) -> None:
    """`gpulab up`'s flags, on `p` (``gpulab up``, ``gpulab service install``)."""
    p.add_argument("--ip", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to serve on (default 8000)")
    p.add_argument("--subdomain-host", default="", metavar="URL",
                   help="serve the hub at URL and each person's server on a host of its own, "
                   "<name>.<host> (JupyterHub's subdomain_host), so that pages a server serves "
                   "cannot act in the hub as whoever opens them. Default where --ip is loopback "
                   "(127.0.0.1, ::1): http://localhost:<port> (browsers resolve *.localhost to "
                   "this machine with no DNS). For people on the network give a name with a "
                   "wildcard DNS record (lab.example.org, with *.lab.example.org); a bare host "
                   "name means http://<name>:<port>. Without either: one origin for all (see "
                   "the README, Users and isolation)")
    p.add_argument("--no-subdomains", action="store_true",
                   help="serve every server on the hub's own origin, even on loopback (not "
                   "recommended: pages a server serves then run as the hub's own; the hub "
                   "refuses what it can tell they sent, which a determined page gets past)")
    p.add_argument("--hub-port", type=int, default=8081,
                   help="loopback port of the hub's internal API (default 8081)")
    p.add_argument("--proxy-api-port", type=int, default=8001,
                   help="loopback port of the proxy's API (default 8001)")
    p.add_argument("--service-port", type=int, default=8002,
                   help="loopback port of the gpulab service (quotas, jobs; default 8002)")
    p.add_argument("--data-dir", default=None,
                   help="folder for all state: database, secrets, logs "
                   "(default $GPULAB_DATA_DIR, else /var/lib/gpulab as root, "
                   "~/.local/share/gpulab otherwise)")
    p.add_argument("--shared-dir", default=None,
                   help="shared storage folder with datasets/ and users/<name>/ "
                   "(default <data-dir>/shared)")
    p.add_argument("--admin-user", default="admin",
                   help="name of the first admin account (default admin)")
    p.add_argument("--idle-timeout", type=int, default=3600,
                   help="stop servers idle for this many seconds (default 3600; 0: never)")
    p.add_argument("--cull-every", type=int, default=0,
                   help="how often to look for idle servers, seconds (default: timeout/10, 5..300)")
    p.add_argument("--simulated-gpus", type=int, default=None,
                   help="number of simulated GPUs where no real GPU is found (default 4)")
    p.add_argument("--user-prefix", default=None,
                   help="prefix of the system accounts made for users as root (default jupyter-)")
    p.add_argument("--no-isolation", action="store_true",
                   help="as root, still run every server as root's account (not recommended)")
    p.add_argument("--proxy", default=None, help="path of configurable-http-proxy")
    p.add_argument("--log-level", default="INFO", help="hub log level (default INFO)")


def _check_port(name: str, value: int) -> str | None:
    if not 1 <= value <= 65535:
        return f"{name} must be a port number between 1 and 65535, got {value}."
    return None


def subdomain_host_url(value: str, port: int) -> str:
    """``--subdomain-host``'s value as a URL: a bare host name gets ``http://`` and `port`."""
    value = value.strip().rstrip("/")
    if value and "://" not in value:
        value = f"http://{value}" + ("" if ":" in value or port == 80 else f":{port}")
    return value


#: the addresses where ``localhost`` (and, in browsers, every ``*.localhost`` name) leads
LOOPBACK_IPS = ("127.0.0.1", "::1", "localhost")


def default_subdomain_host(ip: str, port: int) -> str:
    """``gpulab up``'s ``subdomain_host`` without ``--subdomain-host``: where the hub listens on
    loopback, ``http://localhost:<port>`` (browsers resolve ``*.localhost`` to loopback with
    no DNS, RFC 6761, so each server gets an origin of its own at no cost); elsewhere '' (one
    origin for all: people reach the hub by an address or a name without subdomains)."""
    return f"http://localhost:{port}" if ip in LOOPBACK_IPS else ""


def chosen_subdomain_host(args) -> str:
    """The ``subdomain_host`` `args` ask for: ``--subdomain-host``, else none with
    ``--no-subdomains``, else `default_subdomain_host`."""
    if args.subdomain_host:
        return subdomain_host_url(args.subdomain_host, args.port)
    if args.no_subdomains:
        return ""
    return default_subdomain_host(args.ip, args.port)


def subdomain_host_problem(url: str) -> str | None:
    """What is wrong with `url` as ``--subdomain-host`` (None: nothing)."""
    import ipaddress
    from urllib.parse import urlsplit

    if not url:
        return None
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        return f"--subdomain-host {url!r} is not a URL: {e}."
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        return f"--subdomain-host {url!r} must be http(s)://<host name>[:port]."
    if parts.path.strip("/") or parts.query or parts.fragment:
        return f"--subdomain-host {url!r} must have no path: people's servers get <name>.{host}."
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return (f"--subdomain-host {url!r} is an address, and an address has no subdomains: give "
            "a host name (http://localhost:<port> on this machine, or a name with a wildcard "
            "DNS record).")


def check_up_args(args) -> str | None:
    """What is wrong with `gpulab up`'s flags in `args`, in words (None: nothing)."""
    for name, value in (("--port", args.port), ("--hub-port", args.hub_port),
                        ("--proxy-api-port", args.proxy_api_port),
                        ("--service-port", args.service_port)):
        problem = _check_port(name, value)
        if problem:
            return problem
    if len({args.port, args.hub_port, args.proxy_api_port, args.service_port}) != 4:
        return ("--port, --hub-port, --proxy-api-port and --service-port must be four "
                "different ports.")
    if args.idle_timeout < 0:
        return f"--idle-timeout must be 0 (never) or a number of seconds, got {args.idle_timeout}."
    if args.cull_every < 0:
        return f"--cull-every must be a number of seconds, got {args.cull_every}."
    if args.simulated_gpus is not None and args.simulated_gpus < 0:
        return f"--simulated-gpus must be 0 or more, got {args.simulated_gpus}."
    if args.admin_user.strip() != args.admin_user or not args.admin_user or "/" in args.admin_user:
        return f"--admin-user {args.admin_user!r} is not a usable user name."
    if args.subdomain_host and args.no_subdomains:
        return "--subdomain-host and --no-subdomains contradict each other: give one."
    return subdomain_host_problem(subdomain_host_url(args.subdomain_host, args.port))


def cmd_up(args) -> int:
    from gpulab.hub.deploy.local import LocalSettings

    problem = check_up_args(args)
    if problem:
        return fail(problem)

    chp = find_proxy(args.proxy)
    if chp is None:
        return fail(
            "configurable-http-proxy was not found. Install it with the README's set-up "
            "command (bash scripts/run.sh), or `npm install -g configurable-http-proxy`, "
            "or name it with --proxy."
        )

    # whatever the hub, the proxy and the gpulab service write (pid files, logs, databases,
    # certificates) is private to this account; servers set their own umask (022)
    os.umask(0o077)
    data = DataDir.at(args.data_dir or default_data_dir(), args.shared_dir)
    try:
        data.prepare()
        data.check_database()
        password, created = data.admin_password()
        data.cookie_secret()
    except DataDirError as e:
        return fail(str(e))

    proxy_running = pid_alive(_pid_from(data.proxy_pid_file))
    hub_pid = _pid_from(data.hub_pid_file)
    if hub_pid != os.getpid() and pid_alive(hub_pid):
        return fail(
            f"a gpulab hub (pid {hub_pid}) is already running on {data.path}; stop it first."
        )
    ports = [(args.ip, args.port, "--port"), ("127.0.0.1", args.hub_port, "--hub-port"),
             ("127.0.0.1", args.proxy_api_port, "--proxy-api-port"),
             ("127.0.0.1", args.service_port, "--service-port")]
    for ip, port, flag in ports:
        # A proxy left running by a hub that crashed still holds its ports; the hub replaces it.
        if flag in ("--port", "--proxy-api-port") and proxy_running:
            continue
        # a gpulab service left by a hub that was killed exits within a second: wait for it
        patience = time.monotonic() + (5 if flag == "--service-port" else 0)
        while port_in_use(ip, port):
            if time.monotonic() > patience:
                return fail(f"{ip}:{port} ({flag}) is already in use. Choose another with {flag}.")
            time.sleep(0.25)

    root = os.geteuid() == 0
    isolate = root and not args.no_isolation
    settings = LocalSettings(
        data=data,
        ip=args.ip,
        port=args.port,
        hub_port=args.hub_port,
        proxy_api_port=args.proxy_api_port,
        service_port=args.service_port,
        admin_user=args.admin_user,
        idle_timeout=args.idle_timeout,
        cull_every=args.cull_every,
        chp_command=chp,
        simulated_gpus=args.simulated_gpus,
        isolate_users=isolate,
        user_prefix=args.user_prefix,
        subdomain_host=chosen_subdomain_host(args),
    )

    if isolate:
        blocked = _not_traversable(data.shared)
        if blocked:
            return fail(
                f"{blocked} is not reachable by other accounts (it lacks o+x), so users' "
                f"servers could not reach the shared folder {data.shared}. Choose a "
                "--data-dir/--shared-dir elsewhere (e.g. under /srv) or run chmod o+x on it."
            )

    url = f"http://{'[' + args.ip + ']' if ':' in args.ip else args.ip}:{args.port}/"
    if settings.subdomain_host:
        url = settings.subdomain_host + "/"
    banner = [f"gpulab: data folder {data.path}", f"gpulab: shared storage {data.shared}"]
    if created and sys.stdout.isatty():
        # shown once, and only to a person at a terminal: output that goes to a file or a
        # log collector keeps no password (it is in the 0600 file either way)
        banner += [
            "",
            f"gpulab: first start: created the admin account '{args.admin_user}'",
            f"gpulab:   password: {password}",
            f"gpulab:   (shown once; kept for the operator in {data.admin_password_file}, mode 0600)",
        ]
    elif created:
        banner += [
            "",
            f"gpulab: first start: created the admin account '{args.admin_user}'; its "
            f"password is in {data.admin_password_file} (mode 0600: sudo cat it)",
        ]
    else:
        banner.append(
            f"gpulab: admin account '{args.admin_user}'; its first password is in "
            f"{data.admin_password_file}"
        )
    banner += [
        f"gpulab: people sign up at {url}hub/signup; approve them at {url}hub/authorize",
        f"gpulab: open {url} in a browser. Ctrl-C stops the hub and all servers.",
    ]
    if not isolate:
        banner += [
            "",
            "gpulab: WARNING " + "*" * 60,
            "gpulab: WARNING users are NOT isolated from each other: every server runs as",
            f"gpulab: WARNING this account ({_account()}) and can read every user's files.",
            "gpulab: WARNING Run gpulab up as root to give each user a system account.",
            "gpulab: WARNING " + "*" * 60,
        ]
    if not settings.subdomain_host:
        how = (f"Leave out --no-subdomains (then http://localhost:{args.port}),"
               if args.no_subdomains else
               f"Give --subdomain-host http://localhost:{args.port} on this machine,")
        banner += [
            "",
            "gpulab: WARNING " + "*" * 60,
            "gpulab: WARNING people's servers share the hub's web origin (no subdomains):",
            "gpulab: WARNING a page served by one person's server, opened by another, runs as",
            "gpulab: WARNING the hub's own. The hub refuses requests it can tell came from",
            "gpulab: WARNING such pages, but a determined page gets past that (README, Users",
            f"gpulab: WARNING and isolation). {how}",
            "gpulab: WARNING or --subdomain-host with a host name that has a wildcard DNS",
            "gpulab: WARNING record (lab.example.org with *.lab.example.org).",
            "gpulab: WARNING " + "*" * 60,
        ]
    gpu_gap = _gpus_not_enforced() if isolate else None
    if gpu_gap:
        banner += [
            "",
            "gpulab: WARNING " + "*" * 60,
            "gpulab: WARNING this machine has NVIDIA GPUs, but their device nodes cannot be",
            "gpulab: WARNING restricted per server and job here:",
            f"gpulab: WARNING {gpu_gap}.",
            "gpulab: WARNING CUDA_VISIBLE_DEVICES is then only advice: anyone's process can",
            "gpulab: WARNING use every GPU, outside any quota (see the README, Isolation).",
            "gpulab: WARNING " + "*" * 60,
        ]
    print("\n".join(banner), flush=True)

    # jsonschema (through JupyterHub's event log) checks the "iri" formats with
    # rfc3987-syntax when that is installed, whose grammar is built as it is imported: 1.5 to
    # 3.5 s of every start on a loaded two-core machine (bench/startup.py). No schema the hub
    # validates uses those formats; without the module, jsonschema leaves them unchecked.
    sys.modules.setdefault("rfc3987_syntax", None)
    from gpulab.hub.deploy.localhub import run_local_hub

    return run_local_hub(settings, log_level=args.log_level)


def _gpus_not_enforced(dev: str = "/dev") -> str | None:
    """Why this machine's real NVIDIA GPUs cannot be restricted per server and job (None when
    they can, or when there are none)."""
    import glob
    import re

    if not [p for p in glob.glob(os.path.join(dev, "nvidia*")) if re.fullmatch(r"nvidia\d+", os.path.basename(p))]:
        return None
    from gpulab.hub.machine.cgroups import local_cgroups

    cgroups, why = local_cgroups()
    if cgroups is None:
        return f"no control groups: {why}"
    return cgroups.devices_why or None


def _not_traversable(path: Path) -> Path | None:
    """The first folder on the way to `path` that other accounts cannot pass through."""
    for folder in [*reversed(path.parents), path]:
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def _account() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name
