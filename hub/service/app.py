"""The gpulab service: quotas, GPU holdings and usage over REST, an admin page and a user page.

A JupyterHub managed service at ``/services/gpulab/``
(``python -m gpulab.hub.service --config=<file>``),
tornado handlers authenticated by the hub (`HubOAuthenticated`: browser cookies through
OAuth, or ``Authorization: token …``).

Permissions are JupyterHub scopes: every request needs ``access:services!service=gpulab``;
the custom scope ``custom:gpulab:admin`` (granted by the ``gpulab-admin`` role to the first
admin and to the group ``gpulab-admins``) is needed to see other people or change quotas.
Anonymous API requests get 401; tokens without the scopes get 403.

This module is the application: ONE route table (`make_app`), the job backends' factories
and `main`. What lives where:

- `gpulab.hub.service.hubapi`: `HubDirectory`, the client of the hub's API;
- `gpulab.hub.service.base`: the handler base (`Base`, `APIHandler`, `FieldError`, JSON checks);
- `gpulab.hub.service.quotas`: quotas, holdings, usage, audit: view builders and handlers;
- `gpulab.hub.service.jobs`: the training-job handlers;
- `gpulab.hub.service.pages`: the user and admin pages, error pages, `page_context`, templates;
- `gpulab.hub.service.metrics`: ``/metrics`` for Prometheus (`MetricsHandler`, the ledger's
  collector);
- `gpulab.hub.service.reconciler`: closing allocations of servers the hub no longer has,
  stopping the jobs of people it no longer has;
- `gpulab.hub.service.tls`: `ServiceTLS`.

The names of those modules are imported here too, as before the split.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import signal
import sys
import threading
from pathlib import Path

from jupyterhub.services.auth import HubOAuth
from jupyterhub.utils import url_path_join
from tornado import web
from traitlets import Bool, Float, Unicode, default
from traitlets.config import Application
from tornado.ioloop import IOLoop, PeriodicCallback

from gpulab.hub.quota.ledger import Ledger
from gpulab.hub.service import exit_at_once
from gpulab.hub.service import (ACCESS_SCOPE, ADMIN_SCOPE, RECONCILE_ENV,  # noqa: F401
                                SERVICE_NAME, USAGE_ENV)
from gpulab.hub.service.base import (DAY, MAX_BODY, MAX_BUFFERED_BODY, MAX_JSON_DEPTH,  # noqa: F401
                                     APIHandler, Base, FieldError, check_json_values, log)
from gpulab.hub.service.hubapi import HubDirectory
from gpulab.hub.service.idle import IdleCuller, IdleHandler, KeepHandler
from gpulab.hub.service.metrics import MetricsHandler, make_registry
from gpulab.hub.service.queue import QueueActionHandler, QueueHandler
from gpulab.hub.service.jobs import (JobHandler, JobLeaseHandler, JobLogsHandler, JobsBase,  # noqa: F401
                                     JobsHandler,
                                     JobStopHandler)
from gpulab.hub.service.pages import (AdminPage, ErrorPages, NotFoundHandler,  # noqa: F401
                                      OAuthCallbackHandler, PageError, PageHandler, PageUser,
                                      UserPage, _pages, page_context)
from gpulab.hub.service.quotas import (AllocationsHandler, AuditHandler,  # noqa: F401
                                       EffectiveQuotasHandler, MeHandler,
                                       QuotaHandler, QuotasHandler, UsageHandler, inventory_view,
                                       overview,
                                       user_view)
from gpulab.hub.service.reconciler import (close_orphaned_notebooks,  # noqa: F401
                                           start_notebook_reconciler, stop_jobs_of_departed)
from gpulab.hub.service.tls import ServiceTLS


class OpenAPIHandler(web.RequestHandler):
    def get(self):
        from gpulab.hub.service.openapi import openapi_document

        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(openapi_document(self.settings["service_prefix"])))




class FrameAncestors(web.OutputTransform):
    """Every answer of the service (pages, API, errors, redirects) says who may frame it:
    ``Content-Security-Policy: frame-ancestors 'self'`` (JupyterHub's own pages send the same),
    so that another site cannot put the service's pages (the quota forms) in a frame and trick
    a person into clicking them. A policy a handler set is kept, with the directive added if
    it has none."""

    DIRECTIVE = "frame-ancestors 'self'"

    def transform_first_chunk(self, status_code, headers, chunk, finishing):
        policy = headers.get("Content-Security-Policy", "").strip().rstrip(";")
        if "frame-ancestors" not in policy:
            headers["Content-Security-Policy"] = (f"{policy}; {self.DIRECTIVE}" if policy
                                                  else self.DIRECTIVE)
        return status_code, headers, chunk


async def read_people_once(directory: HubDirectory) -> None:
    """The hub's users read in full once (`HubDirectory.users`); a failure is left for the
    admin page's own read."""
    try:
        await directory.users()
    except Exception as e:
        log.info("The hub's users were not read at start (%s); the admin page reads them", e)


def make_app(ledger: Ledger, prefix: str, hub_prefix: str, directory: HubDirectory,
             on_quota_change=None, jobs=None, job_limits=None,
             tls: "ServiceTLS | None" = None, gpu_usage=None,
             idle_culler=None) -> web.Application:
    """The service's tornado application; with `tls`, its calls to the hub (token checks)
    go over mutual TLS with the service's own certificate, verifying the hub's; with
    `gpu_usage` (a `PoolUsage`), holdings and replicas say how busy their GPUs are."""
    from gpulab.hub.jobs.spec import DEFAULT_LIMITS

    api = url_path_join(prefix, "api/v1")
    name = r"([^/]+)"
    if jobs is not None:  # the bounds a backend applies as it admits (replicas per person…)
        jobs.limits = job_limits or DEFAULT_LIMITS
    app = web.Application(
        [
            (prefix, UserPage),
            (url_path_join(prefix, "admin"), AdminPage),
            (url_path_join(prefix, "oauth_callback"), OAuthCallbackHandler),
            (url_path_join(api, "me"), MeHandler),
            (url_path_join(api, "quotas"), QuotasHandler),
            (url_path_join(api, "quotas/effective"), EffectiveQuotasHandler),
            (url_path_join(api, "quotas/(default)"), QuotaHandler),
            (url_path_join(api, f"quotas/(users|groups)/{name}"), QuotaHandler),
            (url_path_join(api, "allocations"), AllocationsHandler),
            (url_path_join(api, "usage"), UsageHandler),
            (url_path_join(api, "audit"), AuditHandler),
            (url_path_join(api, "idle"), IdleHandler),
            (url_path_join(api, f"servers/{name}/keep"), KeepHandler),
            (url_path_join(api, "jobs"), JobsHandler),
            (url_path_join(api, f"jobs/{name}"), JobHandler),
            (url_path_join(api, f"jobs/{name}/stop"), JobStopHandler),
            (url_path_join(api, f"jobs/{name}/lease"), JobLeaseHandler),
            (url_path_join(api, f"jobs/{name}/logs/{name}"), JobLogsHandler),
            (url_path_join(api, "queue"), QueueHandler),
            (url_path_join(api, "queue/([^/]+)/([^/]+)"), QueueActionHandler),
            (url_path_join(api, "openapi.json"), OpenAPIHandler),
            # Prometheus' text format, for a token with read:metrics (as /hub/metrics)
            (url_path_join(prefix, "metrics"), MetricsHandler),
        ],
        ledger=ledger,
        directory=directory,
        service_prefix=prefix,
        hub_prefix=hub_prefix,
        hub_auth=HubOAuth(cache_max_age=5, access_scopes={ACCESS_SCOPE},
                          **(tls.hub_auth_kwargs() if tls else {})),
        cookie_secret=os.urandom(32),
        xsrf_cookies=False,  # HubOAuth checks xsrf on cookie-authenticated requests itself
        default_handler_class=NotFoundHandler,
        on_quota_change=on_quota_change or (lambda scope, name: directory.forget()),
        jobs=jobs,
        # people's disks, sized by the quotas' ``disk`` (None: no disk limits here)
        disks=getattr(jobs, "disks", None),
        job_limits=job_limits or DEFAULT_LIMITS,
        gpu_usage=gpu_usage,
        idle_culler=idle_culler,
        # the registry /metrics renders, its ledger collector, and the lock of one render
        metrics=(*make_registry(), threading.Lock()),
    )
    app.add_transform(FrameAncestors)
    return app




def usage_from_env(ledger: Ledger, env=None, interval: float | None = None,
                   source: str | None = None, kube_jobs: str | None = None):
    """A `PoolUsage` over the pool's GPUs, read every `interval` seconds
    (`GpulabService.usage_seconds`; without it ``GPULAB_USAGE_SECONDS``, default 5; 0: not
    measured) from `source` (`GpulabService.usage_source`, JSON: NVML by default, the
    stand-in file, DCGM). With NVML, a counting pool (Kubernetes: no device numbers, the GPUs
    are on the nodes) has nothing this process can read; with DCGM, GPUs are labelled by the
    pods that hold them, named as `kube_jobs`' namespace template says."""
    from gpulab.hub.machine.gpuusage import PoolUsage, pod_owner, usage_source

    if interval is None:
        env = os.environ if env is None else env
        interval = float(env.get(USAGE_ENV) or 5)
    settings = json.loads(source) if source else {}
    devices = ledger.devices()
    src = usage_source(settings)
    if not interval or (not devices and src is None):
        return None
    owner_of = None
    if settings.get("source") == "dcgm":
        template = "gpulab-{username}"
        try:
            template = json.loads(kube_jobs or "{}").get("namespace_template") or template
        except ValueError:
            pass
        try:
            from kubespawner.slugs import safe_slug
        except ImportError:  # pragma: no cover - kubespawner is a dependency
            def safe_slug(name):
                return name.lower()

        def slug(name):  # KubeSpawner leaves names it may use as they are
            import re
            return name if re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) else safe_slug(name)

        def owner_of(u, allocations):
            return pod_owner(u, allocations, namespace_template=template, slug=slug)
    return PoolUsage(devices, interval, source=src, owner_of=owner_of)


def local_backend_from_env(ledger: Ledger, shared: str | None = None, isolate: bool | None = None,
                           prefix: str | None = None, python: str | None = None,
                           queue: str | None = None):
    """The local job backend, from the service's settings (`GpulabService.shared_dir`…; each
    left None: from the environment variable it replaces). ``queue``: the GPU queue's
    settings as JSON (`gpulab.hub.quota.waiting.GPUQueue.settings_json`)."""
    shared = os.environ.get("GPULAB_SHARED_DIR") if shared is None else shared
    if not shared:
        return None
    from gpulab.hub.machine.accounts import ensure_account, prepare_user_folder, safe_name, system_username

    from gpulab.hub.jobs.local import LocalJobBackend, UserAccount, runtime_problem

    isolate = os.environ.get("GPULAB_ISOLATE") == "1" if isolate is None else isolate
    prefix = os.environ.get("GPULAB_USER_PREFIX", "jupyter-") if prefix is None else prefix

    def account(user: str) -> UserAccount:
        # the spawner's mapping and checks (gpulab.hub.machine.accounts): an account or folder
        # made for another hub user is never used (AccountConflict)
        folder = Path(shared) / "users" / safe_name(user)
        if not isolate:
            prepare_user_folder(folder, None)
            return UserAccount(user, folder)
        entry = ensure_account(system_username(prefix, user), user)
        prepare_user_folder(folder, entry)
        return UserAccount(user, folder, entry.pw_uid, entry.pw_gid, entry.pw_dir)

    python = python or os.environ.get("GPULAB_JOB_PYTHON") or sys.executable
    from gpulab.hub.quota.waiting import queue_from_json

    queue = os.environ.get("GPULAB_QUEUE") if queue is None else queue
    backend = LocalJobBackend(ledger, account, python=python,
                              queue=queue_from_json(ledger, queue))
    if isolate and os.geteuid() == 0:  # people's disks (loop mounts need root)
        from gpulab.hub.machine.userdisk import PersonDisks

        def existing(user: str):
            try:
                return pwd.getpwnam(system_username(prefix, user))
            except KeyError:
                return None

        backend.disks = PersonDisks(ledger, shared, existing)
    backend.unavailable = runtime_problem(python)
    if backend.unavailable:
        log.error("%s", backend.unavailable)
    return backend


def kube_backend_from_env(ledger: Ledger, backend: str | None = None, settings: str | None = None):
    """The Kubernetes job backend when the hub asks for it (`GpulabService.job_backend`
    ``kubernetes``, settings in `GpulabService.kube_jobs`; each left None: from
    ``GPULAB_JOB_BACKEND`` and ``GPULAB_KUBE_JOBS``, see `gpulab.hub.jobs.kube.backend_settings`)."""
    backend = os.environ.get("GPULAB_JOB_BACKEND") if backend is None else backend
    if backend != "kubernetes":
        return None
    from gpulab.hub.jobs.kube import SETTINGS_ENV
    from gpulab.hub.jobs.kueue import backend_from_settings

    return backend_from_settings(ledger, os.environ.get(SETTINGS_ENV) if settings is None
                                 else settings)


def _env(name: str, fallback: str = "") -> str:
    return os.environ.get(name) or fallback


class GpulabService(Application):
    """The gpulab service as a configurable application, as JupyterHub's own apps are.

    Its settings are traits, set in a traitlets config file (``--config=<file>``, Python or
    JSON: ``c.GpulabService.ledger_url = ...``) or on the command line; a trait set nowhere
    falls back to the environment variable it replaces (named in its help,
    `gpulab.hub.service.ENV_FALLBACKS`), so a hub that passes those keeps working: a value in
    the config file wins over the variable. Both deployments write the file
    (`gpulab.hub.deploy.serviceconfig`). What JupyterHub itself gives every managed service
    (``JUPYTERHUB_SERVICE_URL``, ``JUPYTERHUB_API_TOKEN``, ``JUPYTERHUB_SERVICE_PREFIX``,
    ``JUPYTERHUB_BASE_URL``, ``JUPYTERHUB_API_URL``) stays in the environment.
    """

    name = "gpulab-service"
    description = "The gpulab service: quotas, GPU holdings, usage and training jobs."

    aliases = {"config": "GpulabService.config_file", "log-level": "Application.log_level"}

    config_file = Unicode("", help="""A traitlets config file (``.py`` or ``.json``) with the
        service's settings, loaded at start; empty: none (settings from the command line and
        the environment). Example: ``python -m gpulab.hub.service --config=/srv/gpulab_service_config.py``.
        """).tag(config=True)

    ledger_url = Unicode(help="""The SQLAlchemy URL of the GPU ledger the service reads and
        writes (the hub's ``c.GPULedger.url``). Default: ``$GPULAB_LEDGER_URL``. It may hold a
        password: keep the file that sets it private.
        Example: ``c.GpulabService.ledger_url = "sqlite:////srv/gpulab/ledger.sqlite"``.
        """).tag(config=True)

    @default("ledger_url")
    def _ledger_url_default(self):
        return _env("GPULAB_LEDGER_URL")

    ledger_pool = Unicode(help="""The ledger's pool of GPUs this hub admits from (``local``:
        this machine's devices). Default: ``$GPULAB_LEDGER_POOL``, else ``local``.
        Example: ``c.GpulabService.ledger_pool = "local"``.""").tag(config=True)

    @default("ledger_pool")
    def _ledger_pool_default(self):
        return _env("GPULAB_LEDGER_POOL", "local")

    job_limits = Unicode(help="""The training jobs' limits as JSON (the hub's
        ``c.GPUJobs.limits_json``, `gpulab.hub.jobs.spec.limits_from_json`); empty: the
        defaults. Default: ``$GPULAB_JOB_LIMITS``.
        Example: ``c.GpulabService.job_limits = '{"max_replicas_per_user": 4}'``.
        """).tag(config=True)

    @default("job_limits")
    def _job_limits_default(self):
        return _env("GPULAB_JOB_LIMITS")

    reconcile_seconds = Float(help="""Seconds between two runs of the reconciler that closes
        the notebook allocations of servers the hub no longer has and stops the training jobs
        of people whose account was deleted (0: never). Default:
        ``$GPULAB_RECONCILE_SECONDS``, else 60. Example: ``c.GpulabService.reconcile_seconds = 60``.
        """).tag(config=True)

    @default("reconcile_seconds")
    def _reconcile_default(self):
        return float(_env(RECONCILE_ENV, "60"))

    usage_seconds = Float(help="""Seconds between two reads of the pool's GPUs' usage (NVML;
        0: not measured). Default: ``$GPULAB_USAGE_SECONDS``, else 5.
        Example: ``c.GpulabService.usage_seconds = 5``.""").tag(config=True)

    @default("usage_seconds")
    def _usage_default(self):
        return float(_env(USAGE_ENV, "5"))

    job_backend = Unicode(help="""``kubernetes``: training jobs run as Kubernetes objects
        (settings in `kube_jobs`); anything else: the local backend when `shared_dir` is set.
        Default: ``$GPULAB_JOB_BACKEND``. Example: ``c.GpulabService.job_backend = "kubernetes"``.
        """).tag(config=True)

    usage_source = Unicode(help="""Where GPU usage comes from, as JSON (the hub's
        ``c.GPUInventory.usage_settings()``: ``{"source": "nvml" | "stand-in" | "dcgm",
        "stand_in_file": ..., "dcgm_url": ...}``); empty: NVML. Default:
        ``$GPULAB_USAGE_SOURCE``. Example:
        ``c.GpulabService.usage_source = '{"source": "dcgm", "dcgm_url": "http://dcgm:9400/metrics"}'``.
        """).tag(config=True)

    @default("usage_source")
    def _usage_source_default(self):
        return _env("GPULAB_USAGE_SOURCE")

    idle = Unicode(help="""GPU-idle culling's settings as JSON (the hub's ``c.GPUIdle``,
        `gpulab.hub.quota.idle.GPUIdle.settings_json`); empty: off. Default: ``$GPULAB_IDLE``.
        Example: ``c.GpulabService.idle = '{"default": {"mode": "warn"}}'``.""").tag(config=True)

    @default("idle")
    def _idle_default(self):
        return _env("GPULAB_IDLE")

    @default("job_backend")
    def _job_backend_default(self):
        return _env("GPULAB_JOB_BACKEND")

    kube_jobs = Unicode(help="""The Kubernetes job backend's settings as JSON
        (`gpulab.hub.jobs.kube.backend_settings` of the hub's ``c.KubeJobBackend``). Default:
        ``$GPULAB_KUBE_JOBS``. Example: ``c.GpulabService.kube_jobs = '{"namespace": "gpulab"}'``.
        """).tag(config=True)

    @default("kube_jobs")
    def _kube_jobs_default(self):
        return _env("GPULAB_KUBE_JOBS")

    shared_dir = Unicode(help="""The shared folder of the local job backend (people's folders
        under ``users/``); empty: no local training jobs. Default: ``$GPULAB_SHARED_DIR``.
        Example: ``c.GpulabService.shared_dir = "/srv/gpulab/shared"``.""").tag(config=True)

    @default("shared_dir")
    def _shared_dir_default(self):
        return _env("GPULAB_SHARED_DIR")

    isolate = Bool(help="""Whether local jobs run as each person's own system account (as the
        spawner isolates servers). Default: ``$GPULAB_ISOLATE`` is ``1``.
        Example: ``c.GpulabService.isolate = True``.""").tag(config=True)

    @default("isolate")
    def _isolate_default(self):
        return os.environ.get("GPULAB_ISOLATE") == "1"

    user_prefix = Unicode(help="""The prefix of the system accounts of isolated people.
        Default: ``$GPULAB_USER_PREFIX``, else ``jupyter-``.
        Example: ``c.GpulabService.user_prefix = "jupyter-"``.""").tag(config=True)

    @default("user_prefix")
    def _user_prefix_default(self):
        return os.environ.get("GPULAB_USER_PREFIX", "jupyter-")

    job_python = Unicode(help="""The Python that runs local training jobs. Default:
        ``$GPULAB_JOB_PYTHON``, else the service's own.
        Example: ``c.GpulabService.job_python = "/opt/tf/bin/python"``.""").tag(config=True)

    @default("job_python")
    def _job_python_default(self):
        return _env("GPULAB_JOB_PYTHON", sys.executable)

    queue = Unicode(help="""The GPU queue's settings as JSON (the hub's ``c.GPUQueue``,
        `gpulab.hub.quota.waiting.GPUQueue.settings_json`); empty: the defaults (queue on).
        Local jobs only: on Kubernetes, queueing is Kueue's. Default: ``$GPULAB_QUEUE``.
        Example: ``c.GpulabService.queue = '{"half_life_hours": 24}'``.""").tag(config=True)

    @default("queue")
    def _queue_default(self):
        return _env("GPULAB_QUEUE")

    ssl_keyfile = Unicode(help="""The service's TLS key (its certificate signed by the hub's
        CA, `gpulab.hub.deploy.localhub.service_certificate`); the four ``ssl_*`` settings go
        together, all empty: plain HTTP. Default: ``$GPULAB_SSL_KEYFILE``.
        Example: ``c.GpulabService.ssl_keyfile = "/srv/gpulab/tls/internal-ssl/gpulab-service/gpulab-service.key"``.
        """).tag(config=True)

    @default("ssl_keyfile")
    def _ssl_keyfile_default(self):
        return _env("GPULAB_SSL_KEYFILE")

    ssl_certfile = Unicode(help="""The service's TLS certificate, shown to every client and
        to the hub. Default: ``$GPULAB_SSL_CERTFILE``.
        Example: ``c.GpulabService.ssl_certfile = "/srv/gpulab/tls/internal-ssl/gpulab-service/gpulab-service.crt"``.
        """).tag(config=True)

    @default("ssl_certfile")
    def _ssl_certfile_default(self):
        return _env("GPULAB_SSL_CERTFILE")

    ssl_client_ca = Unicode(help="""The bundle of the hub's internal CAs: the only clients
        the service accepts (the hub, the proxy, notebook servers). Default:
        ``$GPULAB_SSL_CLIENT_CA``.
        Example: ``c.GpulabService.ssl_client_ca = "/srv/gpulab/tls/internal-ssl/hub-ca_trust.crt"``.
        """).tag(config=True)

    @default("ssl_client_ca")
    def _ssl_client_ca_default(self):
        return _env("GPULAB_SSL_CLIENT_CA")

    ssl_hub_ca = Unicode(help="""The hub's CA alone, the only one that may answer for the
        hub's API. Default: ``$GPULAB_SSL_HUB_CA``.
        Example: ``c.GpulabService.ssl_hub_ca = "/srv/gpulab/tls/internal-ssl/hub-ca/hub-ca.crt"``.
        """).tag(config=True)

    @default("ssl_hub_ca")
    def _ssl_hub_ca_default(self):
        return _env("GPULAB_SSL_HUB_CA")

    def initialize(self, argv=None) -> None:
        super().initialize(argv)
        if self.config_file:
            path = os.path.abspath(self.config_file)
            self.load_config_file(os.path.basename(path), path=os.path.dirname(path))

    def start(self) -> None:
        logging.basicConfig(level=logging.INFO, format="[%(levelname)1.1s %(asctime)s gpulab-service] %(message)s")
        from urllib.parse import urlparse

        url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
        prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", f"/services/{SERVICE_NAME}/")
        # the hub's pages and static files: a path of this host, or with subdomain_host (the
        # service on a host of its own) the hub's public address, which JupyterHub gives
        hub_prefix = (os.environ.get("JUPYTERHUB_PUBLIC_HUB_URL", "").rstrip("/") + "/"
                      if os.environ.get("JUPYTERHUB_PUBLIC_HUB_URL")
                      else os.environ.get("JUPYTERHUB_BASE_URL", "/") + "hub/")
        ledger = Ledger(self.ledger_url, pool=self.ledger_pool)
        ledger.migrate()
        tls = ServiceTLS.from_settings(self.ssl_keyfile, self.ssl_certfile, self.ssl_client_ca,
                                       self.ssl_hub_ca)
        if tls is not None:
            tls.configure_http_client()
        directory = HubDirectory(os.environ["JUPYTERHUB_API_URL"], os.environ["JUPYTERHUB_API_TOKEN"])
        jobs = (kube_backend_from_env(ledger, self.job_backend, self.kube_jobs)
                or local_backend_from_env(ledger, self.shared_dir, self.isolate, self.user_prefix,
                                          self.job_python, queue=self.queue))
        from gpulab.hub.jobs.spec import limits_from_json

        from gpulab.hub.quota.idle import IdleSettings

        usage = usage_from_env(ledger, interval=self.usage_seconds, source=self.usage_source,
                               kube_jobs=self.kube_jobs)
        idle = IdleSettings.from_json(self.idle)
        culler = None
        if usage is not None and idle.active:
            culler = IdleCuller(ledger, usage, directory, idle, jobs=jobs)
            culler.start(self.usage_seconds)
        elif idle.active:
            log.warning("GPU-idle culling is set but GPU usage is not measured here "
                        "(c.GPUInventory.usage_interval, usage_source): nothing is culled")
        app = make_app(ledger, prefix, hub_prefix, directory, jobs=jobs,
                       job_limits=limits_from_json(self.job_limits), tls=tls,
                       gpu_usage=usage, idle_culler=culler)
        if jobs is not None:
            jobs.recover()
            IOLoop.current().add_callback(jobs.ensure_supervisor)
        start_notebook_reconciler(ledger, directory, self.reconcile_seconds, jobs=jobs)
        # the hub's people read once now: on a hub where that is slow (thousands of people)
        # the admin page's first load shows them as read, never waiting for the whole list
        IOLoop.current().add_callback(read_people_once, directory)
        # tornado buffers a body whole before a handler sees it (100 MB by default): bound it.
        # Up to this size an oversized body gets the handlers' clear 413 (`json_body`); past it
        # tornado refuses the request from its Content-Length alone, before reading it
        app.listen(url.port, url.hostname, max_body_size=MAX_BUFFERED_BODY,
                   ssl_options=tls.server_context() if tls is not None else None)
        # The hub manages this process; if the hub dies (kill -9), go too, so that the next
        # `gpulab up` finds the port free and starts a fresh service.
        hub_pid = os.getppid()

        def exit_if_orphaned():
            if os.getppid() != hub_pid:
                log.warning("The hub (pid %s) is gone; the gpulab service stops.", hub_pid)
                IOLoop.current().stop()

        PeriodicCallback(exit_if_orphaned, 500).start()

        def stop(sig: signal.Signals) -> None:
            # the hub stops its services with SIGINT (Ctrl-C reaches this process too): a line
            # in the log, not a KeyboardInterrupt traceback; training jobs go on (see jobs.py)
            log.info("gpulab service: %s, stopping", sig.name)
            IOLoop.current().stop()

        for sig in (signal.SIGINT, signal.SIGTERM):
            IOLoop.current().asyncio_loop.add_signal_handler(sig, stop, sig)
        log.info("gpulab service at %s%s (ledger %s)", url.geturl(), prefix, ledger.engine.url.render_as_string(hide_password=True))
        IOLoop.current().start()
        # stopped: what runs in worker threads (a ledger write) ends first; then the process
        # ends without the interpreter's teardown of every module, which held the hub's
        # Ctrl-C for a second or more (bench/startup.py); training jobs go on either way
        loop = IOLoop.current().asyncio_loop
        loop.run_until_complete(loop.shutdown_default_executor())
        exit_at_once(0)


def main(argv=None) -> None:
    """``python -m gpulab.hub.service [--config=<file>]``."""
    GpulabService.launch_instance(argv)


if __name__ == "__main__":
    main()
