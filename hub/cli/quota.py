"""``gpulab quota`` and ``gpulab usage``: the gpulab service's API from a terminal.

They talk to ``<hub-url>/services/gpulab/api/v1/`` with a hub API token: ``--token``, else
``$GPULAB_TOKEN``, else ``$JUPYTERHUB_API_TOKEN`` (set inside notebook servers). Make a token
on the hub's Token page (``/hub/token``). ``--url`` is the hub's address; without it the
service is found as the notebook client finds it (`gpulab.extensions.client.service_url_from_env`:
inside a notebook server ``$GPULAB_SERVICE_URL``, the service itself; else ``$GPULAB_URL``,
else ``http://127.0.0.1:8000``). Over ``https`` the service's certificate is verified as the
notebook client does (`gpulab.extensions.client.ssl_context`) before the token is sent.

``--url``, ``--token`` and ``--json`` go before the command or after it
(``gpulab --url X jobs list`` and ``gpulab jobs list --url X``); given in both places, the
later one wins (`add_global_options`, `apply_global_options`).

``gpulab quota set --user NAME`` (or ``--group``) first asks the hub's REST API
(``/hub/api/users/NAME``, same token) whether the user or group exists, and refuses a name the
hub does not know unless ``--force`` is given (`check_exists`).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from urllib.parse import quote

EXIT_USAGE, EXIT_API = 2, 1

#: the options of every client command, also accepted before the command
CLIENT_OPTIONS = ("url", "token", "json")
#: the commands that call the hub (``jobs export`` does not)
CLIENT_COMMANDS = ("quota", "usage", "jobs")


class APIError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def common(p) -> None:
    """The options every client command takes: where the hub is, the token, JSON output."""
    p.add_argument("--url", default=None,
                   help="the hub's address (default $GPULAB_URL, else http://127.0.0.1:8000)")
    p.add_argument("--token", default=None,
                   help="hub API token (default $GPULAB_TOKEN, else $JUPYTERHUB_API_TOKEN)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")


def add_global_options(p, level: str = "top") -> None:
    """`common`'s options on a parser above the action (``gpulab --url X jobs list``,
    ``gpulab jobs --url X list``), kept apart (``_top_url``…) so that `apply_global_options`
    can let the later one win: argparse would otherwise let a sub-command's default
    (``None``) overwrite a value given before it."""
    g = p.add_argument_group("hub options (quota, usage, jobs; also after the command)")
    g.add_argument("--url", dest=f"_{level}_url", default=None, metavar="URL",
                   help="the hub's address (default $GPULAB_URL, else http://127.0.0.1:8000)")
    g.add_argument("--token", dest=f"_{level}_token", default=None, metavar="TOKEN",
                   help="hub API token (default $GPULAB_TOKEN, else $JUPYTERHUB_API_TOKEN)")
    g.add_argument("--json", dest=f"_{level}_json", action="store_true",
                   help="print JSON for scripts")


def apply_global_options(args) -> str | None:
    """Fold the options given before the action into ``args.url``, ``args.token`` and
    ``args.json`` (the one nearest the end of the command line wins); what is wrong, in
    words, when they were given to a command that does not call the hub."""
    levels = ("action", "group", "top")  # the later on the command line, the earlier here
    given = [name for name in CLIENT_OPTIONS
             if any(getattr(args, f"_{lv}_{name}", None) for lv in levels[1:])]
    calls_hub = args.command in CLIENT_COMMANDS and not (
        args.command == "jobs" and getattr(args, "action", None) == "export")
    if given and args.command and not calls_hub:
        what = "gpulab " + args.command + (" export" if args.command == "jobs" else "")
        return (f"--{given[0]} is an option of the commands that call the hub (quota, usage, "
                f"jobs), not of `{what}`; see `{what} -h`.")
    if not calls_hub:
        return None
    for name in CLIENT_OPTIONS:
        values = [getattr(args, name, None)] + [getattr(args, f"_{lv}_{name}", None)
                                                for lv in levels[1:]]
        setattr(args, name, next((v for v in values if v), None if name != "json" else False))
    return None


def add_client_parsers(sub) -> None:
    from gpulab.hub.cli.jobs import add_jobs_parser

    q = sub.add_parser("quota", help="show or change GPU quotas (through the gpulab service)")
    add_global_options(q, "group")
    qs = q.add_subparsers(dest="action", metavar="ACTION")
    show = qs.add_parser("show", help="my quota and holdings, or (admins) every quota set")
    show.add_argument("--all", action="store_true", help="every quota set (admins)")
    common(show)
    for name, text in (("set", "set a quota (admins)"), ("unset", "remove a quota (admins)")):
        p = qs.add_parser(name, help=text)
        who = p.add_mutually_exclusive_group(required=True)
        who.add_argument("--user")
        who.add_argument("--group")
        who.add_argument("--default", action="store_true")
        if name == "set":
            p.add_argument("--max-gpus", type=int, required=True, help="GPUs held at once")
            p.add_argument("--max-per-request", type=int, default=None)
            p.add_argument("--gpu-hours", type=float, default=None,
                           help="GPU-hour budget over the window")
            p.add_argument("--window-hours", type=int, default=None,
                           help="rolling window of the budget, hours (e.g. 168)")
            p.add_argument("--force", action="store_true",
                           help="set it even for a user or group the hub does not know (yet)")
        common(p)
    u = sub.add_parser("usage", help="GPU-hours per user and group")
    u.add_argument("--days", type=int, default=7, help="window in days (default 7)")
    common(u)
    add_jobs_parser(sub)


def fail_api(e: APIError) -> int:
    print(f"gpulab: error: {e.message}" + (f" (HTTP {e.status})" if e.status else ""),
          file=sys.stderr)
    return EXIT_API


def _token(args) -> str:
    token = args.token or os.environ.get("GPULAB_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN")
    if not token:
        raise APIError(0, "No token: pass --token, or set GPULAB_TOKEN (make one on the hub's "
                       "Token page, /hub/token).")
    return token


def _http(args, method: str, url: str, body=None, what: str = ""):
    """One request with the token; the decoded JSON answer, or `APIError`."""
    from gpulab.extensions.client import Client

    token = _token(args)
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"token {token}",
                                          "Content-Type": "application/json"})
    try:
        context = Client(url=url, token=token).tls_context() if url.startswith("https:") else None
        with urllib.request.urlopen(req, timeout=30, context=context) as resp:
            raw = resp.read()
            return json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["message"]
        except Exception:
            message = e.reason
        raise APIError(e.code, message) from None
    except (urllib.error.URLError, OSError) as e:
        raise APIError(0, f"Cannot reach {what or url}: {getattr(e, 'reason', e)}.") from None
    except ValueError:
        raise APIError(0, f"{what or url} answered something that is not JSON; is this the "
                       "right address?") from None


def _call(args, method: str, path: str, body=None):
    from gpulab.extensions.client import SERVICE_PATH, service_url_from_env

    base = (args.url.rstrip("/") + "/" + SERVICE_PATH) if args.url else service_url_from_env()
    return _http(args, method, f"{base}api/v1/{path}", body, what=base.rstrip("/"))


def hub_url(args) -> str:
    """The hub's public address (ending in ``/``): --url, $GPULAB_URL, the public hub URL a
    notebook server is given, else ``http://127.0.0.1:8000/``."""
    from gpulab.extensions.client import DEFAULT_HUB_URL

    hub = args.url or os.environ.get("GPULAB_URL")
    if not hub:
        public = os.environ.get("JUPYTERHUB_PUBLIC_HUB_URL", "").rstrip("/")
        hub = public[: -len("/hub")] if public.endswith("/hub") else public
    return (hub or DEFAULT_HUB_URL).rstrip("/") + "/"


def hub_api_url(args) -> str:
    """The hub's REST API (``…/hub/api/``): the hub's address, or inside a notebook server
    without one, the hub API the server was given (``$JUPYTERHUB_API_URL``)."""
    inside = os.environ.get("JUPYTERHUB_API_URL")
    if inside and not (args.url or os.environ.get("GPULAB_URL")):
        return inside.rstrip("/") + "/"
    return hub_url(args) + "hub/api/"


#: hub scopes that let ``GET /hub/api/users/<name>`` (``groups/<name>``) answer for anyone:
#: without one of them unfiltered, the hub answers 404 for names it will not show, too
_READ_SCOPES = {"user": ("read:users", "read:users:name", "read:servers", "read:users:groups",
                         "read:users:activity", "read:roles:users"),
                "group": ("read:groups", "read:groups:name", "read:roles:groups")}


def check_exists(args, kind: str, name: str) -> tuple[bool | None, str]:
    """Whether the hub has the user (``kind`` ``user``) or group ``name``: True, False, or
    None when this token cannot tell (then with why)."""
    api = hub_api_url(args)
    what = "the hub's API at " + api.rstrip("/")
    try:
        me = _http(args, "GET", api + "user", what=what)
    except APIError as e:
        return None, f"the hub's API did not answer ({e.message})"
    if not isinstance(me, dict) or "scopes" not in me:
        return None, f"{api} is not the hub's API"
    if kind == "user" and me.get("name") == name:
        return True, ""
    try:
        _http(args, "GET", api + ("users/" if kind == "user" else "groups/") + quote(name, safe=""),
              what=what)
        return True, ""
    except APIError as e:
        if e.status == 404 and set(_READ_SCOPES[kind]) & set(me["scopes"]):
            return False, ""
        return None, (f"this token may not read the hub's {kind}s (a hub admin's may)"
                      if e.status in (403, 404) else f"the hub's API did not answer ({e.message})")


def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _dash(v):
    return "-" if v is None else v


def _num(x) -> str:
    return str(int(x)) if float(x) == int(x) else f"{x:g}"


def describe_quota(row: dict) -> str:
    """Every field of a quota as stored, in words: ``2 GPUs at once, at most 1 per request,
    100 GPU-hours per 168-hour window (7 days)``; fields left unset are said too (a ``set``
    replaces the whole quota)."""
    n = row["max_gpus"]
    parts = [f"{n} GPU{'' if n == 1 else 's'} at once"]
    per = row.get("max_per_request")
    parts.append("no per-request limit" if per is None else f"at most {per} per request")
    hours, window = row.get("gpu_hours"), row.get("window_hours")
    if hours is None:
        parts.append("no GPU-hour budget")
    else:
        days = ""
        if window and window % 24 == 0:
            days = f" ({window // 24} day{'' if window == 24 else 's'})"
        parts.append(f"{_num(hours)} GPU-hours per {window}-hour window{days}")
    return ", ".join(parts)


def _refuse(message: str) -> int:
    print(f"gpulab: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _check_target(args, kind: str, name: str) -> int | None:
    """Refuse (an exit code) a user or group the hub does not know; None to go on."""
    exists, why = check_exists(args, kind, name)
    if exists:
        return None
    page = hub_url(args) + ("services/gpulab/admin" if kind == "user" else "hub/admin")
    if exists is False:
        return _refuse(f"the hub has no {kind} '{name}'. Check the name ({kind}s are listed at "
                       f"{page}), or add --force to set it anyway.")
    # the hub would not say: a token without the gpulab admin scope is refused by the
    # service anyway, with its own message, so only a gpulab admin is stopped here
    if not _call(args, "GET", "me").get("admin"):
        return None
    return _refuse(f"cannot check that the {kind} '{name}' exists: {why}. Check the name "
                   f"({kind}s are listed at {page}), then add --force to set it.")


def cmd_quota(args) -> int:
    if args.action is None:
        print("gpulab quota: choose show, set or unset (see gpulab quota -h)", file=sys.stderr)
        return EXIT_USAGE
    kind, name = (("user", args.user) if getattr(args, "user", None) is not None else
                  ("group", args.group) if getattr(args, "group", None) is not None else
                  ("default", ""))
    if kind != "default" and not name.strip():
        return _refuse(f"--{kind} needs a name.")
    target = "default" if kind == "default" else f"{kind}s/{quote(name, safe='')}"
    label = "the default quota" if kind == "default" else f"the quota of {kind} '{name}'"
    try:
        if args.action == "show" and not args.all:
            me = _call(args, "GET", "me")
            if args.json:
                print(json.dumps(me, indent=2))
                return 0
            src = "" if me["quota_source"] in ("user", "none") else f" (from {me['quota_source']})"
            print(f"{me['user']}: {me['quota_text']}{src}; {me['gpus_held']} GPU(s) in use")
            if me["holdings"]:
                print(table([[h["kind"], h["name"], h["gpus"], ",".join(map(str, h["devices"])),
                              "; ".join(u["text"] for u in h.get("usage") or ())]
                             for h in me["holdings"]], ["KIND", "NAME", "GPUS", "DEVICES", "GPU USE"]))
            u = me["usage_gpu_hours"]
            print(f"GPU-hours: {u['7d']} over 7 days, {u['30d']} over 30 days")
        elif args.action == "show":
            quotas = _call(args, "GET", "quotas")["quotas"]
            if args.json:
                print(json.dumps(quotas, indent=2))
                return 0
            print(table([[q["scope"], q["name"] or "-", q["max_gpus"], _dash(q["max_per_request"]),
                          _dash(q["gpu_hours"]), _dash(q["window_hours"]), q["updated_by"]]
                         for q in quotas],
                        ["SCOPE", "NAME", "MAX GPUS", "PER REQUEST", "GPU-HOURS", "WINDOW H", "BY"]))
        elif args.action == "set":
            if kind != "default" and not args.force:
                refused = _check_target(args, kind, name)
                if refused is not None:
                    return refused
            body = {"max_gpus": args.max_gpus}
            for k in ("max_per_request", "gpu_hours", "window_hours"):
                if getattr(args, k) is not None:
                    body[k] = getattr(args, k)
            row = _call(args, "PUT", f"quotas/{target}", body)
            print(json.dumps(row, indent=2) if args.json else
                  f"set {row['scope']} quota{' ' + row['name'] if row['name'] else ''}: "
                  f"{describe_quota(row)}")
        else:
            _call(args, "DELETE", f"quotas/{target}")
            print(json.dumps({"unset": "default" if kind == "default" else f"{kind}s/{name}"})
                  if args.json else f"unset {label}")
    except APIError as e:
        return fail_api(e)
    return 0


def cmd_usage(args) -> int:
    try:
        usage = _call(args, "GET", f"usage?days={args.days}")
    except APIError as e:
        return fail_api(e)
    if args.json:
        print(json.dumps(usage, indent=2))
        return 0
    print(f"GPU-hours over the last {usage['days']} days")
    print(table([["user", k, v] for k, v in usage["users"].items()] +
                [["group", k, v] for k, v in usage["groups"].items()], ["KIND", "NAME", "GPU-HOURS"]))
    return 0
