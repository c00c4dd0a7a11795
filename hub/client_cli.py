"""``gpulab quota`` and ``gpulab usage``: the gpulab service's API from a terminal.

They talk to ``<hub-url>/services/gpulab/api/v1/`` with a hub API token: ``--token``, else
``$GPULAB_TOKEN``, else ``$JUPYTERHUB_API_TOKEN`` (set inside notebook servers). Make a token
on the hub's Token page (``/hub/token``). ``--url`` is the hub's address; without it the
service is found as the notebook client finds it (`gpulab.extensions.client.service_url_from_env`:
inside a notebook server ``$GPULAB_SERVICE_URL``, the service itself; else ``$GPULAB_URL``,
else ``http://127.0.0.1:8000``). Over ``https`` the service's certificate is verified as the
notebook client does (`gpulab.extensions.client.ssl_context`) before the token is sent.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

EXIT_USAGE, EXIT_API = 2, 1


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


def add_client_parsers(sub) -> None:
    from .jobs_cli import add_jobs_parser

    q = sub.add_parser("quota", help="show or change GPU quotas (through the gpulab service)")
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
        common(p)
    u = sub.add_parser("usage", help="GPU-hours per user and group")
    u.add_argument("--days", type=int, default=7, help="window in days (default 7)")
    common(u)
    add_jobs_parser(sub)


def fail_api(e: APIError) -> int:
    print(f"gpulab: error: {e.message}" + (f" (HTTP {e.status})" if e.status else ""),
          file=sys.stderr)
    return EXIT_API


def _call(args, method: str, path: str, body=None):
    from gpulab.extensions.client import SERVICE_PATH, Client, service_url_from_env

    base = (args.url.rstrip("/") + "/" + SERVICE_PATH) if args.url else service_url_from_env()
    url = base.rstrip("/")
    token = args.token or os.environ.get("GPULAB_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN")
    if not token:
        raise APIError(0, "No token: pass --token, or set GPULAB_TOKEN (make one on the hub's "
                       "Token page, /hub/token).")
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{base}api/v1/{path}", data=data, method=method,
                                 headers={"Authorization": f"token {token}",
                                          "Content-Type": "application/json"})
    try:
        context = Client(url=base, token=token).tls_context() if base.startswith("https:") else None
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
        raise APIError(0, f"Cannot reach {url}: {getattr(e, 'reason', e)}.") from None


def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _dash(v):
    return "-" if v is None else v


def cmd_quota(args) -> int:
    if args.action is None:
        print("gpulab quota: choose show, set or unset (see gpulab quota -h)", file=sys.stderr)
        return EXIT_USAGE
    target = ("default" if getattr(args, "default", False) else
              f"users/{args.user}" if getattr(args, "user", None) else
              f"groups/{args.group}" if getattr(args, "group", None) else None)
    try:
        if args.action == "show" and not args.all:
            me = _call(args, "GET", "me")
            if args.json:
                print(json.dumps(me, indent=2))
                return 0
            src = "" if me["quota_source"] in ("user", "none") else f" (from {me['quota_source']})"
            print(f"{me['user']}: {me['quota_text']}{src}; {me['gpus_held']} GPU(s) in use")
            if me["holdings"]:
                print(table([[h["kind"], h["name"], h["gpus"], ",".join(map(str, h["devices"]))]
                             for h in me["holdings"]], ["KIND", "NAME", "GPUS", "DEVICES"]))
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
            body = {"max_gpus": args.max_gpus}
            for k in ("max_per_request", "gpu_hours", "window_hours"):
                if getattr(args, k) is not None:
                    body[k] = getattr(args, k)
            row = _call(args, "PUT", f"quotas/{target}", body)
            print(json.dumps(row, indent=2) if args.json else
                  f"set {row['scope']} quota{' ' + row['name'] if row['name'] else ''}: "
                  f"{row['max_gpus']} GPUs at once")
        else:
            _call(args, "DELETE", f"quotas/{target}")
            print(json.dumps({"unset": target}) if args.json else f"unset quota {target}")
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
