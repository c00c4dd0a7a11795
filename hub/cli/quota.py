"""``gpulab quota`` and ``gpulab usage``: quotas and GPU-hours through the gpulab service.

The hub options, the token and the service's client are `gpulab.hub.cli.common`'s.

``gpulab quota set --user NAME`` (or ``--group``) first asks the hub's REST API
(``/hub/api/users/NAME``, same token, same TLS checks) whether the user or group exists, and
refuses a name the hub does not know unless ``--force`` is given (`check_exists`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from urllib.parse import quote

from gpulab.extensions.client import DEFAULT_HUB_URL, GpulabError

from gpulab.hub.quota.policy import disk_text
from gpulab.hub.cli.common import (EXIT_USAGE, add_global_options, common, error_text, fail,
                                   fail_api, hub_client, table)


def add_quota_parsers(sub) -> None:
    """``gpulab quota show|set|unset`` and ``gpulab usage``."""
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
            p.add_argument("--disk", default=None,
                           help="disk on the shared storage, e.g. 20G or 512M (binary units)")
            p.add_argument("--force", action="store_true",
                           help="set it even for a user or group the hub does not know (yet)")
        common(p)
    u = sub.add_parser("usage", help="GPU-hours per user and group")
    u.add_argument("--days", type=int, default=7, help="window in days (default 7)")
    common(u)
    k = sub.add_parser("keep", help="keep a server whose GPUs sit idle from being stopped "
                       "(GPU-idle culling) for some hours")
    k.add_argument("server", nargs="?", default="default",
                   help="the server's name (default: the default server)")
    k.add_argument("--hours", type=float, required=True,
                   help="how long, at most the hub's c.GPUIdle.keep_max_hours")
    k.add_argument("--user", default=None, help="(admins) another person's server")
    common(k)


def cmd_keep(args) -> int:
    params = {"user": args.user} if args.user else None
    try:
        kept = hub_client(args).request("POST", f"servers/{quote(args.server, safe='')}/keep",
                                        body={"hours": args.hours}, params=params)
    except GpulabError as e:
        return fail_api(e)
    if args.json:
        print(json.dumps(kept, indent=2))
        return 0
    until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(kept["kept_until"]))
    print(f"{kept['user']}'s server '{kept['server']}' is kept until {until} "
          f"(at most {kept['max_hours']:g} h may be asked)")
    return 0


def hub_url(args) -> str:
    """The hub's public address (ending in ``/``): --url, $GPULAB_URL, the public hub URL a
    notebook server is given, else ``http://127.0.0.1:8000/``."""
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
        client = hub_client(args)
        me = client.call("GET", api + "user")
    except GpulabError as e:
        return None, f"the hub's API did not answer ({error_text(e, what)})"
    if not isinstance(me, dict) or "scopes" not in me:
        return None, f"{api} is not the hub's API"
    if kind == "user" and me.get("name") == name:
        return True, ""
    try:
        client.call("GET", api + ("users/" if kind == "user" else "groups/") + quote(name, safe=""))
        return True, ""
    except GpulabError as e:
        if e.status == 404 and set(_READ_SCOPES[kind]) & set(me["scopes"]):
            return False, ""
        return None, (f"this token may not read the hub's {kind}s (a hub admin's may)"
                      if e.status in (403, 404) else f"the hub's API did not answer ({error_text(e, what)})")


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
    disk = row.get("disk")
    parts.append("no disk limit" if disk is None else f"{disk_text(disk)} disk")
    return ", ".join(parts)


def _check_target(args, kind: str, name: str) -> int | None:
    """Refuse (an exit code) a user or group the hub does not know; None to go on."""
    exists, why = check_exists(args, kind, name)
    if exists:
        return None
    # the service's own page: on a host of its own where the hub has --subdomain-host
    page = (hub_client(args).service_url() + "admin" if kind == "user"
            else hub_url(args) + "hub/admin")
    if exists is False:
        return fail(f"the hub has no {kind} '{name}'. Check the name ({kind}s are listed at "
                    f"{page}), or add --force to set it anyway.")
    # the hub would not say: a token without the gpulab admin scope is refused by the
    # service anyway, with its own message, so only a gpulab admin is stopped here
    if not hub_client(args).me().get("admin"):
        return None
    return fail(f"cannot check that the {kind} '{name}' exists: {why}. Check the name "
                f"({kind}s are listed at {page}), then add --force to set it.")


def cmd_quota(args) -> int:
    if args.action is None:
        print("gpulab quota: choose show, set or unset (see gpulab quota -h)", file=sys.stderr)
        return EXIT_USAGE
    kind, name = (("user", args.user) if getattr(args, "user", None) is not None else
                  ("group", args.group) if getattr(args, "group", None) is not None else
                  ("default", ""))
    if kind != "default" and not name.strip():
        return fail(f"--{kind} needs a name.")
    target = "default" if kind == "default" else f"{kind}s/{quote(name, safe='')}"
    label = "the default quota" if kind == "default" else f"the quota of {kind} '{name}'"
    try:
        client = hub_client(args)
        if args.action == "show" and not args.all:
            me = client.me()
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
            quotas = client.request_all("quotas", "quotas")  # every page
            if args.json:
                print(json.dumps(quotas, indent=2))
                return 0
            print(table([[q["scope"], q["name"] or "-", q["max_gpus"], _dash(q["max_per_request"]),
                          _dash(q["gpu_hours"]), _dash(q["window_hours"]),
                          "-" if q.get("disk") is None else disk_text(q["disk"]), q["updated_by"]]
                         for q in quotas],
                        ["SCOPE", "NAME", "MAX GPUS", "PER REQUEST", "GPU-HOURS", "WINDOW H",
                         "DISK", "BY"]))
        elif args.action == "set":
            if kind != "default" and not args.force:
                refused = _check_target(args, kind, name)
                if refused is not None:
                    return refused
            body = {"max_gpus": args.max_gpus}
            for k in ("max_per_request", "gpu_hours", "window_hours", "disk"):
                if getattr(args, k) is not None:
                    body[k] = getattr(args, k)
            row = client.request("PUT", f"quotas/{target}", body)
            print(json.dumps(row, indent=2) if args.json else
                  f"set {row['scope']} quota{' ' + row['name'] if row['name'] else ''}: "
                  f"{describe_quota(row)}")
        else:
            client.request("DELETE", f"quotas/{target}")
            print(json.dumps({"unset": "default" if kind == "default" else f"{kind}s/{name}"})
                  if args.json else f"unset {label}")
    except GpulabError as e:
        return fail_api(e)
    return 0


def cmd_usage(args) -> int:
    try:
        client = hub_client(args)
        usage = client.request("GET", "usage", params={"days": args.days, "limit": 1000})
        # the service pages people and groups: every page, in one table
        while (usage.get("_pagination") or {}).get("next"):
            more = client.request("GET", "usage", params={
                "days": args.days, **usage.pop("_pagination")["next"]})
            usage["users"].update(more["users"])
            usage["groups"].update(more["groups"])
            usage["_pagination"] = more.get("_pagination")
        usage.pop("_pagination", None)
    except GpulabError as e:
        return fail_api(e)
    if args.json:
        print(json.dumps(usage, indent=2))
        return 0
    print(f"GPU-hours over the last {usage['days']} days")
    print(table([["user", k, v] for k, v in usage["users"].items()] +
                [["group", k, v] for k, v in usage["groups"].items()], ["KIND", "NAME", "GPU-HOURS"]))
    return 0
