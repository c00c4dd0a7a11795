"""What every ``gpulab`` command shares: exit codes, the hub options (``--url``, ``--token``,
``--json``, before or after the command), the client of the gpulab service, how its errors
are printed, and the plain-text table.

The commands that call the hub (``quota``, ``usage``, ``jobs``) talk to
``<hub-url>/services/gpulab/api/v1/`` through the notebook side's own client,
`gpulab.extensions.client.Client` (`hub_client`): the same requests, TLS checks, errors and log
following. The token is ``--token``, else ``$GPULAB_TOKEN``, else ``$JUPYTERHUB_API_TOKEN``
(set inside notebook servers; make one on the hub's Token page, ``/hub/token``). ``--url`` is
the hub's address; without it the service is found as the notebook client finds it
(`gpulab.extensions.client.service_url_from_env`: inside a notebook server
``$GPULAB_SERVICE_URL``, the service itself; else ``$GPULAB_URL``, else
``http://127.0.0.1:8000``). A hub with ``--subdomain-host`` keeps the service on a host of its
own; the client finds it there from the hub's address alone (`Client.find_service`). Over
``https`` the service's certificate is verified as the notebook client does
(`gpulab.extensions.client.ssl_context`) before the token is sent.

``--url``, ``--token`` and ``--json`` go before the command or after it
(``gpulab --url X jobs list`` and ``gpulab jobs list --url X``); given in both places, the
later one wins (`add_global_options`, `apply_global_options`).

Errors of the service become ``gpulab: error: <message> (HTTP <status>)`` and exit code 1
(`fail_api`); wrong use of the command line exits 2 (`fail`).
"""

from __future__ import annotations

import sys

from gpulab.extensions.client import Client, GpulabError, token_from_env

EXIT_USAGE, EXIT_API = 2, 1

#: the options of every client command, also accepted before the command
CLIENT_OPTIONS = ("url", "token", "json")
#: the commands that call the hub (``jobs export`` does not)
CLIENT_COMMANDS = ("quota", "usage", "jobs", "keep")


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


def hub_client(args) -> Client:
    """The gpulab service's client for these options (``--url`` is the hub's address);
    `GpulabError` when there is no token."""
    token = args.token or token_from_env()
    if not token:
        raise GpulabError("No token: pass --token, or set GPULAB_TOKEN (make one on the hub's "
                          "Token page, /hub/token).", kind="no-token")
    if args.url:
        return Client(hub_url=args.url, token=token)
    return Client(token=token)


def error_text(e: GpulabError, what: str | None = None) -> str:
    """`e` in the command's words: the service's own message; the HTTP reason where the
    answer had none; ``Cannot reach <what>: <reason>.`` where nothing answered (`what`: the
    address asked, by default `e`'s)."""
    where = what or (e.address or "").rstrip("/")
    if e.kind == "unreachable":
        return f"Cannot reach {where}: {e.reason}."
    if e.kind == "not-json":
        return f"{where} answered something that is not JSON; is this the right address?"
    if e.kind == "status" and e.reason:
        return e.reason
    return e.message


def fail_api(e: GpulabError) -> int:
    print(f"gpulab: error: {error_text(e)}" + (f" (HTTP {e.status})" if e.status else ""),
          file=sys.stderr)
    return EXIT_API


def fail(message: str) -> int:
    """A refusal of what the command line asks: the message, exit code 2."""
    print(f"gpulab: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
