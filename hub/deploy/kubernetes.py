"""The configuration builder for Kubernetes: what the z2jh chart's hub needs from gpulab.

The chart builds the hub's configuration in its own ``jupyterhub_config.py`` (from ``hub.config``,
``hub.services``, ``hub.loadRoles``, ``cull``, …) and then runs the ``hub.extraConfig`` snippets
with ``c`` and ``get_config`` in scope. ``helm-values/values.yaml`` has one such snippet::

    from gpulab.hub.deploy.kubernetes import kubernetes_config
    gpulab = get_config("custom.gpulab", {})
    kubernetes_config(c, first_admin=gpulab.get("firstAdmin"))

`kubernetes_config` then adds what the local builder (`gpulab.hub.deploy.local`) gives ``gpulab up``:
KubeGPUSpawner, the quota ledger on PostgreSQL, the gpulab service (run by the hub, in the hub
pod, with its settings in a private config file written at the hub's start) with its roles
and scope, the hub's "GPUs" link, the first admin, and the service's
address for notebook servers (``GPULAB_SERVICE_URL``), and the web-origin settings of
`web_origins` (with or without ``subdomain_host``). Services and
roles the operator put in ``hub.services`` / ``hub.loadRoles`` under the same names are kept:
service keys the operator set win, and role members and scopes are joined.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from traitlets.config import Config

from gpulab.hub.cluster.kubeobjects import GPULAB_SERVICE_PORT

from gpulab.hub.deploy.local import gpulab_roles
from gpulab.hub.deploy.serviceconfig import (SERVICE_CONFIG_NAME, private_folder,
                                             service_command, write_service_config)
from gpulab.hub.service import ADMIN_SCOPE, SERVICE_NAME

SPAWNER_CLASS = "gpulab.spawner.kube.KubeGPUSpawner"
#: the port of the gpulab service in the hub pod (the proxy reaches it at the pod's IP; the
#: user namespaces' NetworkPolicies let user pods reach it)
SERVICE_PORT = GPULAB_SERVICE_PORT
LEDGER_URL_ENV = "GPULAB_LEDGER_URL"
POD_IP_ENV = "POD_IP"
POD_NAMESPACE_ENV = "POD_NAMESPACE"


def gpulab_kube_settings(*, ledger_url: str, job_limits: str | None = None,
                         kube_jobs: str | None = None,
                         reconcile_interval: float | None = None,
                         usage_seconds: float | None = None, usage_source: str | None = None,
                         idle: str | None = None) -> dict:
    """The gpulab service's settings (`gpulab.hub.service.app.GpulabService` traits) in the hub
    pod, for its config file (`gpulab.hub.deploy.serviceconfig`); None: left unset."""
    settings = {"ledger_url": ledger_url, "ledger_pool": "kubernetes",
                "job_limits": job_limits, "reconcile_seconds": reconcile_interval}
    # GPU usage from the DCGM exporter (c.GPUInventory), GPU-idle culling (c.GPUIdle)
    for key, value in (("usage_seconds", usage_seconds), ("usage_source", usage_source),
                       ("idle", idle)):
        if value is not None:
            settings[key] = value
    if kube_jobs is not None:  # training jobs as Kubernetes Jobs (gpulab.hub.jobs.kube)
        settings.update(job_backend="kubernetes", kube_jobs=kube_jobs)
    return settings


def gpulab_kube_service(*, config_file: str | os.PathLike, service_ip: str,
                        service_port: int = SERVICE_PORT, hub_namespace: str | None = None,
                        python: str = "python3") -> dict:
    """The gpulab service as a process the hub runs in its own pod, reading its settings from
    ``config_file`` (`gpulab_kube_settings`, written by `kubernetes_config`).

    It listens on the pod's IP (``service_ip``), where the proxy pod reaches it; the hub pod's
    NetworkPolicy must let the proxy in on ``service_port`` (helm-values/values.yaml does).
    ``hub_namespace`` (the release namespace) reaches the job backend as ``$POD_NAMESPACE``
    (a service gets only the environment given here), for the user namespaces'
    NetworkPolicies.
    """
    env = {POD_NAMESPACE_ENV: hub_namespace} if hub_namespace else {}
    return {
        "name": SERVICE_NAME,
        "url": f"http://{service_ip}:{service_port}",
        "command": service_command(python, config_file),
        "environment": env,
        "oauth_client_allowed_scopes": [ADMIN_SCOPE],
        "display": False,  # the navigation's "GPUs" leads to it, not "Services"
        "oauth_no_confirm": True,
    }


def _merge_service(ours: dict, theirs: dict) -> dict:
    """``ours`` with the operator's keys on top (their environment added to ours)."""
    merged = {**ours, **theirs}
    merged["environment"] = {**ours.get("environment", {}), **theirs.get("environment", {})}
    return merged


def _merge_role(ours: dict, theirs: dict) -> dict:
    """One role: the operator's fields win, but scopes and members are the union of both."""
    merged = {**ours, **theirs}
    for key in ("scopes", "users", "groups", "services"):
        items = list(ours.get(key, []))
        items += [x for x in theirs.get(key, []) if x not in items]
        if items:
            merged[key] = items
    return merged


def _merge_named(existing: list[dict], ours: list[dict], merge) -> list[dict]:
    by_name = {entry.get("name"): entry for entry in existing}
    out = [merge(entry, by_name.pop(entry["name"])) if entry["name"] in by_name else entry
           for entry in ours]
    return out + [e for e in existing if e.get("name") in by_name]


def kubernetes_config(
    c: Config,
    *,
    ledger_url: str | None = None,
    first_admin: str | None = None,
    service_ip: str | None = None,
    service_port: int = SERVICE_PORT,
    config_dir: str | os.PathLike | None = None,
) -> Config:
    """Complete the hub configuration ``c`` (as the chart built it) for gpulab on Kubernetes.

    ``ledger_url``: the quota ledger's SQLAlchemy URL, ``postgresql+psycopg://user:pw@host/db``
    (default: ``$GPULAB_LEDGER_URL``, which the values fill from a Secret). ``first_admin``: a
    hub admin who also holds the gpulab-admin role (GPU quotas), before any group says so.
    ``service_ip``: where the gpulab service listens (default: ``$POD_IP``, the hub pod's IP from
    the downward API). ``config_dir``: the folder, made 0700 if missing, where the gpulab
    service's config file is written now, at the hub's config load (it holds the ledger's URL
    and password; default: a new private temporary folder, gone with the pod). Returns ``c``.

    The service's settings go in that file (`gpulab.hub.deploy.serviceconfig`), not in its
    environment; a ``GPULAB_*`` variable the operator sets in the ``environment`` of the
    gpulab entry of ``hub.services`` still wins, as before the file: the file leaves that
    setting out, and the service reads the variable.

    Groups are not loaded here (``load_groups``): with an identity provider they come from the
    login (``manage_groups``), and members of ``gpulab-admins`` get the gpulab-admin role.
    """
    ledger_url = ledger_url or os.environ.get(LEDGER_URL_ENV)
    if not ledger_url:
        raise ValueError(f"gpulab needs its quota ledger's database: set ${LEDGER_URL_ENV} "
                         "(hub.extraEnv) or pass ledger_url, e.g. "
                         "postgresql+psycopg://gpulab:PASSWORD@postgres.gpulab.svc:5432/gpulab")
    service_ip = service_ip or os.environ.get(POD_IP_ENV) or "127.0.0.1"

    c.JupyterHub.spawner_class = SPAWNER_CLASS
    # logging out ends the person's sessions on the hub's side (a copied cookie dies with it),
    # with the authenticator configured so far (hub.config's)
    from gpulab.hub.deploy.auth import end_sessions_at_logout

    end_sessions_at_logout(c)
    c.GPULedger.db_url = ledger_url
    c.GPULedger.pool = "kubernetes"
    # the hub's pages get a "GPUs" link to the gpulab service
    templates = str(Path(__file__).parent.parent / "templates" / "jupyterhub")
    paths = list(c.JupyterHub.get("template_paths", []))
    if templates not in paths:
        c.JupyterHub.template_paths = [templates, *paths]
    scopes = dict(c.JupyterHub.get("custom_scopes", {}))
    scopes.setdefault(ADMIN_SCOPE, {
        "description": "Manage gpulab's GPU quotas and see everyone's GPU use."})
    c.JupyterHub.custom_scopes = scopes

    # the service checks job specs against the limits set in hub.config.GPUJobs
    from gpulab.hub.jobs.spec import GPUJobs

    from gpulab.hub.jobs.kube import backend_settings

    from gpulab.hub.quota.settings import GPULedger

    from gpulab.hub.machine.inventory import GPUInventory

    from gpulab.hub.quota.idle import GPUIdle

    limits = GPUJobs(config=c).limits_json()
    inventory = GPUInventory(config=c)
    idle = GPUIdle(config=c)
    watched = inventory.usage_source != "nvml" or idle.settings().active
    settings = gpulab_kube_settings(ledger_url=ledger_url, job_limits=limits,
                                    kube_jobs=backend_settings(c),
                                    reconcile_interval=GPULedger(config=c).reconcile_interval,
                                    usage_seconds=(float(inventory.usage_interval) if watched
                                                   else None),
                                    usage_source=(json.dumps(inventory.usage_settings())
                                                  if watched else None),
                                    idle=idle.settings_json() if watched else None)
    folder = (private_folder(config_dir) if config_dir is not None
              else Path(tempfile.mkdtemp(prefix="gpulab-service-")))
    existing = list(c.JupyterHub.get("services", []))
    # the operator's variables for the service stay in charge of their settings
    theirs = next((s for s in existing if s.get("name") == SERVICE_NAME), {})
    config_file = write_service_config(folder / SERVICE_CONFIG_NAME, settings,
                                       keep_env=theirs.get("environment", {}))
    service = gpulab_kube_service(config_file=config_file, service_ip=service_ip,
                                  service_port=service_port,
                                  hub_namespace=os.environ.get(POD_NAMESPACE_ENV))
    c.JupyterHub.services = _merge_named(existing, [service], _merge_service)
    roles = gpulab_roles(first_admin or "")
    if not first_admin:
        roles[0]["users"] = []
    c.JupyterHub.load_roles = _merge_named(list(c.JupyterHub.get("load_roles", [])), roles,
                                           _merge_role)
    if first_admin:
        admins = set(c.Authenticator.get("admin_users", set()))
        c.Authenticator.admin_users = admins | {first_admin}
    web_origins(c)
    # notebook servers (the gpulab client and widgets) reach the service through the hub's
    # Service, whose extra port 8002 leads to the service in the hub pod (values.yaml:
    # hub.service.extraPorts); not through the proxy, whose public side may be HTTPS only
    env = dict(c.KubeSpawner.get("environment", {}))
    env.setdefault("GPULAB_SERVICE_URL", service_url_for_servers(service_port))
    c.KubeSpawner.environment = env
    return c


def service_host(subdomain_host: str) -> str:
    """``<scheme>://gpulab--service.<host>[:port]``: where JupyterHub puts the gpulab service
    with ``subdomain_host`` and its default ``subdomain_hook`` (as `jupyterhub.services.
    service.Service.host` builds it)."""
    from urllib.parse import urlsplit

    from jupyterhub.utils import subdomain_hook_idna

    parts = urlsplit(subdomain_host)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{subdomain_hook_idna(SERVICE_NAME, parts.hostname, 'service')}{port}"


def web_origins(c: Config) -> Config:
    """What the local hub (`gpulab.hub.deploy.localhub.GpulabHub`) does about pages of people's
    servers (issue 33.3), for the chart's stock ``jupyterhub`` app, through its settings.

    With ``hub.config.JupyterHub.subdomain_host`` (each server and service on a host of its
    own: docs/deploy-kubernetes.md): the hub's static files carry
    ``Access-Control-Allow-Origin: *`` (the gpulab service's pages, on their own host, load
    the hub's CSS and fonts, which browsers fetch with CORS), the hub's "GPUs" link leads to
    the service's host, and on HTTPS the hub's cookies are ``__Host-`` cookies (a server's
    page cannot toss a cookie the hub would take for its own) unless the operator said
    otherwise. Without it (one origin for all): the hub's pages are sent with
    ``frame-ancestors 'none'`` and ``Cross-Origin-Opener-Policy: same-origin``, so a server's
    page cannot read a hub page (and its XSRF token) through a frame or an opened window;
    the requests such pages send are refused by the chart's hub itself
    (`gpulab.hub.deploy.kubehub`, ``hub.args``). Returns `c`."""
    from gpulab.hub.deploy.userpages import SINGLE_ORIGIN_HEADERS, static_files_for_every_host

    subdomain_host = c.JupyterHub.get("subdomain_host", "")
    tornado = dict(c.JupyterHub.get("tornado_settings", {}))
    if subdomain_host:
        from jupyterhub.handlers.static import CacheControlStaticFilesHandler

        base = tornado.get("static_handler_class", CacheControlStaticFilesHandler)
        if not getattr(base, "gpulab_shared", False):
            tornado["static_handler_class"] = static_files_for_every_host(base)
        template_vars = dict(c.JupyterHub.get("template_vars", {}))
        template_vars.setdefault("gpulab_service_url",
                                 service_host(subdomain_host) + f"/services/{SERVICE_NAME}/")
        c.JupyterHub.template_vars = template_vars
        if subdomain_host.startswith("https://") and "cookie_host_prefix_enabled" not in c.JupyterHub:
            c.JupyterHub.cookie_host_prefix_enabled = True
    else:
        headers = dict(tornado.get("headers", {}))
        for name, value in SINGLE_ORIGIN_HEADERS.items():
            headers.setdefault(name, value)
        tornado["headers"] = headers
    c.JupyterHub.tornado_settings = tornado
    return c


def service_url_for_servers(service_port: int = SERVICE_PORT, environ=None) -> str:
    """``http://hub.<namespace>.svc.cluster.local:<port>/services/gpulab/``: the gpulab
    service as pods in other namespaces reach it (``$POD_NAMESPACE`` is the chart's namespace,
    set in the hub pod by the chart)."""
    environ = os.environ if environ is None else environ
    namespace = environ.get(POD_NAMESPACE_ENV, "default")
    return f"http://hub.{namespace}.svc.cluster.local:{service_port}/services/{SERVICE_NAME}/"
