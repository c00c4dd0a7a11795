"""Run JupyterHub in this process with gpulab's configuration (``gpulab up``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import time
from pathlib import Path

from jupyterhub.app import JupyterHub
from traitlets import Int
from traitlets.config import Config

from gpulab.hub.deploy.local import (LocalSettings, gpulab_service_settings, local_defaults,
                                     local_essentials)
from gpulab.hub.deploy.serviceconfig import write_service_config
from gpulab.hub.deploy.userpages import refuse_user_pages_trait, user_pages_application

LOG_FORMAT = "[%(levelname)1.1s %(asctime)s.%(msecs).03d %(name)s %(module)s:%(lineno)d] %(message)s"


def _merge_named(first: list, second: list) -> list:
    """`first` then the entries of `second` whose ``name`` `first` does not have."""
    names = {entry.get("name") for entry in first}
    return list(first) + [entry for entry in second if entry.get("name") not in names]


def _merge_services(ours: list, theirs: list) -> list:
    """gpulab's services, each with the environment the operator's entry of the same name
    adds (gpulab's own variables win), then the operator's other services. The gpulab
    service's own settings are in its config file, which wins over the variables of its
    environment (`gpulab.hub.deploy.serviceconfig`): as before the file, a ``GPULAB_*`` variable
    the operator gives it changes only a setting gpulab leaves unset."""
    extra = {entry.get("name"): entry.get("environment", {}) for entry in theirs}
    merged = [{**entry, "environment": {**extra[entry["name"]], **entry.get("environment", {})}}
              if extra.get(entry.get("name")) else entry for entry in ours]
    return _merge_named(merged, theirs)


#: the gpulab service's own certificate (in ``internal_certs_location``), signed by the hub's CA
SERVICE_CERT_NAME = "gpulab-service"
#: the gpulab service's settings (`gpulab.hub.service.app.GpulabService`) that name its TLS
#: files, in its config file (`gpulab.hub.service.tls.ServiceTLS.from_settings`)
SERVICE_SSL_SETTINGS = ("ssl_keyfile", "ssl_certfile", "ssl_client_ca", "ssl_hub_ca")


def _alt_names_of(cert_file: str) -> set[str]:
    """The subject alternative names of a certificate, as certipy writes them (``DNS:x``)."""
    from cryptography import x509

    with open(cert_file, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return ({f"DNS:{n}" for n in san.get_values_for_type(x509.DNSName)}
            | {f"IP:{n}" for n in san.get_values_for_type(x509.IPAddress)})


def service_certificate(store_dir: str, trust_bundles: dict, log=None,
                        domain: str = "") -> dict:
    """The gpulab service's key and certificate, made once and signed by the hub's CA.

    JupyterHub gives a managed service a certificate of the *notebooks* CA, the CA that also
    signs every notebook server's certificate, whose key its user can read: a client that
    trusted that CA could not tell the gpulab service from any user's server. The hub's own
    CA signs only the hub's certificate and this one, and both key files stay in the hub's
    private folder; notebook servers trust it already (their ``JUPYTERHUB_SSL_CLIENT_CA``
    bundle holds it, to check the hub's calls), so the notebook client verifies the service
    with the bundle its server was given, and nobody else can pass for it.

    Returns the service's TLS settings (`SERVICE_SSL_SETTINGS`, for its config file): key,
    certificate, the bundle of every internal CA (who may connect: hub, proxy, servers), and
    the hub's CA (to verify the hub's API).
    """
    from certipy import Certipy, CertNotFoundError

    certipy = Certipy(store_dir=store_dir)
    # with subdomain_host the proxy reaches the service under its own host name (`domain`,
    # ``gpulab--service.<host>``) and checks the certificate against it
    names = ["IP:127.0.0.1", "DNS:localhost"] + ([f"DNS:{domain}"] if domain else [])
    try:
        record = certipy.store.get_record(SERVICE_CERT_NAME)
        if not set(names) <= _alt_names_of(record["files"]["cert"]):
            raise CertNotFoundError(SERVICE_CERT_NAME)  # a new name (--subdomain-host): anew
    except CertNotFoundError:
        if log:
            log.info("Creating the gpulab service's certificate (hub CA): %s", ";".join(names))
        record = certipy.create_signed_pair(SERVICE_CERT_NAME, "hub-ca", alt_names=names,
                                            overwrite=True)
    hub_ca = certipy.store.get_record("hub-ca")["files"]["cert"]
    return dict(zip(SERVICE_SSL_SETTINGS, (record["files"]["key"], record["files"]["cert"],
                                      trust_bundles["hub-ca"], hub_ca)))


class RefusalLogs(logging.Filter):
    """A spawn refused for the person's own reasons (a quota, no free GPU, bad options: a
    `SpawnRefused` with a 4xx status) is a one-line WARNING in the hub's log, not an ERROR
    with a traceback: JupyterHub logs every failed spawn from its form with one."""

    def filter(self, record: logging.LogRecord) -> bool:
        from gpulab.spawner.mixin import SpawnRefused

        if record.levelno != logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, SpawnRefused):
            refused = exc.status_code < 500
        else:  # JupyterHub's own lines about it: "Error starting …: HTTP 409: …"
            refused = exc is None and bool(re.search(r"^Error starting .*: HTTP 4\d\d\b",
                                                     record.getMessage()))
        if refused:
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def person_bounds(config: Config, spawner_class=None) -> dict:
    """The person-level bounds and the ``oom_score_adj`` the notebook spawner's settings
    give (``c.LocalGPUSpawner.person_mem_limit`` / ``person_cpu_limit`` / ``oom_score_adj``
    and the hub's tag, `gpulab.hub.machine.cgroups.person_unit`), as `JobLimits` fields: the hub
    hands them to the gpulab service with the job limits, so a person's replicas nest in the
    same group, with the same limits, as their servers. A spawner that is not a
    `LocalGPUSpawner` gives none (replicas then have no person-level group). The jobs'
    ``max_user_processes`` is the spawner's unless ``c.GPUJobs.max_user_processes`` is set."""
    from gpulab.spawner import LocalGPUSpawner

    if not (isinstance(spawner_class, type) and issubclass(spawner_class, LocalGPUSpawner)):
        spawner_class = LocalGPUSpawner if spawner_class is None else None
    if spawner_class is None:
        return {}
    spawner = spawner_class(config=config)
    bounds = {"person_tag": spawner._hub_tag(),
              "person_memory": int(spawner.person_mem_limit or 0),
              "person_cpu": float(spawner.person_cpu_limit or 0),
              "oom_score_adj": int(spawner.oom_score_adj)}
    # RLIMIT_NPROC counts the account's processes in servers and replicas together: one
    # figure. The jobs' follows the spawner's unless c.GPUJobs.max_user_processes is set.
    if "max_user_processes" not in config.get("GPUJobs", {}):
        bounds["max_user_processes"] = int(spawner.max_user_processes)
    elif int(config.GPUJobs.max_user_processes) != int(spawner.max_user_processes):
        logging.getLogger("gpulab").warning(
            "c.GPUJobs.max_user_processes (%s) differs from c.LocalGPUSpawner."
            "max_user_processes (%s): both bound the same account's processes; set one "
            "(the jobs follow the spawner's when c.GPUJobs.max_user_processes is not set)",
            config.GPUJobs.max_user_processes, spawner.max_user_processes)
    return bounds


def _disk_full(e: BaseException) -> bool:
    """Whether a database error says that its file system is full (SQLite's SQLITE_FULL,
    "database or disk is full"; PostgreSQL's 53100 ``disk_full``)."""
    text = str(getattr(e, "orig", e)).lower()
    return "disk is full" in text or "no space left" in text or \
        getattr(getattr(e, "orig", None), "pgcode", None) == "53100"


def keep_tokens_on_a_full_disk() -> None:
    """A hub whose database's file system is full still knows its tokens and cookies.

    JupyterHub records a token's (and its user's) ``last_activity`` as it checks the token,
    and commits. When the file system is full that commit fails ("database or disk is full":
    SQLite writes a journal file for every transaction), the check raises, and every request
    with a token or a cookie was refused (401/403): the hub's API, the gpulab service (which
    asks the hub about every token) and every notebook server, for everyone, while one person
    had filled the disk. Here such a check is rolled back and made again without recording
    the activity (reads need no room), and the hub's log says why. Installed once, on
    JupyterHub's `BaseHandler`."""
    from jupyterhub.handlers.base import BaseHandler
    from sqlalchemy.exc import OperationalError

    for name in ("get_current_user_token", "get_current_user_cookie"):
        original = getattr(BaseHandler, name)
        if getattr(original, "gpulab_full_disk", False):
            continue

        def check(self, _original=original):
            try:
                return _original(self)
            except OperationalError as e:
                if not _disk_full(e):
                    raise
                self.db.rollback()
                self.log.warning("The hub's database cannot record activity (%s): the "
                                 "request is authenticated without it. Free space on the "
                                 "data folder's file system.", getattr(e, "orig", e))
                self._record_activity = lambda obj, timestamp=None: False
                return _original(self)

        check.gpulab_full_disk = True
        check.__doc__ = original.__doc__
        setattr(BaseHandler, name, check)


class GpulabHub(JupyterHub):
    """JupyterHub whose command-line settings (from `gpulab up`) win over the config file,
    which writes the gpulab service's config file before it starts its services, and which
    keeps itself, its proxy and the service out of the OOM killer's reach."""

    gpulab_essentials: Config | None = None
    #: where the gpulab service's config file goes (`DataDir.service_config_file`; None: the
    #: hub writes none), and the service's settings that `gpulab up` decides
    #: (`gpulab.hub.deploy.local.gpulab_service_settings`); the hub adds its own (job limits,
    #: intervals, TLS files) and writes them all in `init_services`
    gpulab_service_config: Path | None = None
    gpulab_service_settings: dict | None = None
    #: all of them, as the hub gathers them (load_config_file, init_internal_ssl)
    _service_settings: dict = {}

    oom_score_adj = Int(
        -900,
        help="""``oom_score_adj`` of the hub (-1000..1000), set as it starts (as root) and
        inherited by what it starts before any person's work: configurable-http-proxy, the
        gpulab service and the idle culler. When the machine runs out of memory the kernel
        kills the process with the highest score: people's servers and replicas
        (``c.LocalGPUSpawner.oom_score_adj``, 500) go first, the hub and its helpers almost
        never. Default -900 (-1000 would make them unkillable even when they are the
        problem). Example: ``c.GpulabHub.oom_score_adj = -500``
        """,
    ).tag(config=True)

    refuse_user_pages = refuse_user_pages_trait()

    def init_tornado_application(self):
        app = user_pages_application(self, self.refuse_user_pages)
        if app is None:
            return super().init_tornado_application()
        self.tornado_application = app

    def _disks_shared(self) -> str | None:
        """The shared storage whose people's disks this hub mounts (`gpulab.hub.machine.userdisk`):
        a `LocalGPUSpawner`'s that isolates people, as root; else None."""
        from gpulab.spawner import LocalGPUSpawner

        spawner = self.spawner_class
        if os.geteuid() != 0 or not (isinstance(spawner, type)
                                     and issubclass(spawner, LocalGPUSpawner)):
            return None
        conf = spawner(config=self.config)
        return conf.shared_dir if conf.isolate_users and conf.shared_dir else None

    async def cleanup(self):
        await super().cleanup()
        # after the servers stopped: people's disks are unmounted, their loop devices go with
        # the last mount (a training job that goes on keeps its own until it ends)
        shared = self._disks_shared()
        if shared:
            from gpulab.hub.machine.userdisk import unmount_all

            gone = await asyncio.to_thread(unmount_all, shared)
            if gone:
                self.log.info("Unmounted %d person's disk(s) on %s", len(gone), shared)

    async def initialize(self, *args, **kwargs):
        keep_tokens_on_a_full_disk()
        await super().initialize(*args, **kwargs)
        shared = self._disks_shared()
        if shared:  # every person's disk at their folder before anything of theirs starts
            from gpulab.hub.machine.userdisk import mount_all

            done = await asyncio.to_thread(mount_all, shared)
            if done:
                self.log.info("Mounted %d person's disk(s) on %s", len(done), shared)
        # before the proxy and the services start (JupyterHub.start): they inherit it
        from gpulab.hub.machine.cgroups import set_oom_score_adj

        if not set_oom_score_adj(self.oom_score_adj):
            (self.log.warning if os.geteuid() == 0 else self.log.info)(
                "The hub's oom_score_adj stays %s (%s needs root with CAP_SYS_RESOURCE, which "
                "some containers drop): the hub, its proxy and the gpulab service score as "
                "high as people's processes that lower theirs", _read_oom_score_adj(),
                self.oom_score_adj)

    #: set when the gpulab service failed to come up: `gpulab up` then exits 1
    gpulab_service_failed = False

    async def start_service(self, service_name, service, ssl_context=None):
        """JupyterHub starts each managed service and waits until it answers (up to 10 s)
        before the proxy routes anything to the hub, so the login page waited for the gpulab
        service's start (its imports and migrations: 1 to 3 s of every start on a loaded
        two-core machine, bench/startup.py). The gpulab service is started the same way,
        but waited for beside the rest: the login page comes as soon as the hub is up, and
        the service's pages answer 503 for the moment it may still take. A service that
        exits or never answers stops the hub as before (`gpulab up` exits 1)."""
        from gpulab.hub.service import SERVICE_NAME

        if service_name != SERVICE_NAME or not service.managed or not service.url:
            return await super().start_service(service_name, service, ssl_context)
        self.log.info("Starting managed service %s at %s", service_name, service.url)
        try:
            await service.start()
        except Exception:
            self.log.critical("Failed to start service %s", service_name, exc_info=True)
            return False
        self._gpulab_service_wait = asyncio.ensure_future(
            self._wait_for_service(service_name, service, ssl_context))
        return True

    async def _wait_for_service(self, service_name, service, ssl_context=None) -> None:
        """JupyterHub's wait for a managed service (`start_service`), off the start's path:
        10 tries of 1 s; if the service exits or never answers, the hub shuts down."""
        import ssl

        from jupyterhub.objects import Server
        from jupyterhub.utils import AnyTimeoutError, make_ssl_context

        if ssl_context is None:
            ssl_context = make_ssl_context(self.internal_ssl_key, self.internal_ssl_cert,
                                           cafile=self.internal_ssl_ca,
                                           purpose=ssl.Purpose.CLIENT_AUTH)
        for _ in range(10):
            try:
                await Server.from_orm(service.orm.server).wait_up(
                    http=True, timeout=1, ssl_context=ssl_context)
            except AnyTimeoutError:
                status = await service.spawner.poll()
                if status is not None:
                    self.log.critical("Service %s exited with status %s", service_name, status)
                    break
            else:
                self.log.info("Service %s is up", service_name)
                return
        else:
            self.log.critical("Cannot connect to %s service %s", service.kind, service_name)
        self.gpulab_service_failed = True
        await self.shutdown_cancel_tasks()

    #: seconds between the lines that say which servers are still stopping (Ctrl-C)
    stop_report_seconds = 2.0

    async def cleanup(self):
        """JupyterHub's clean-up (services, then every server at once, then the proxy), with
        a line saying which servers it stops and, every `stop_report_seconds`, which are
        still stopping and for how long: each gets up to its spawner's
        ``interrupt_timeout`` to shut its kernels down, and a Ctrl-C should not look hung."""
        running = []
        if self.cleanup_servers:
            running = [(user.name + (f"/{name}" if name else ""), spawner)
                       for user in self.users.values()
                       for name, spawner in list(user.spawners.items()) if spawner.active]
        report = None
        if running:
            self.log.info("Stopping %d server(s): %s", len(running),
                          ", ".join(n for n, _ in running))
            report = asyncio.ensure_future(self._report_stopping(running))
        try:
            await super().cleanup()
        finally:
            if report is not None:
                report.cancel()

    async def _report_stopping(self, running) -> None:
        started = time.monotonic()
        while True:
            await asyncio.sleep(self.stop_report_seconds)
            left = [n for n, spawner in running if spawner.active]
            if left:
                self.log.info("Still stopping %d of %d server(s) after %.0f s: %s", len(left),
                              len(running), time.monotonic() - started, ", ".join(left))

    def init_logging(self):
        super().init_logging()
        for handler in self.log.handlers:
            handler.addFilter(RefusalLogs())

    def init_internal_ssl(self):
        if self.internal_ssl:
            # the CAs' keys and the hub's own live here. certipy makes its store folder 0755
            # and certificates 0644 whenever it writes one, so the store lives inside a
            # folder that only the hub's account may enter (gpulab up: <data>/tls/)
            store = os.path.abspath(self.internal_certs_location)
            parent = os.path.dirname(store)
            os.makedirs(parent, mode=0o700, exist_ok=True)
            os.chmod(parent, 0o700)
            os.makedirs(store, mode=0o700, exist_ok=True)
            os.chmod(store, 0o700)
        super().init_internal_ssl()
        if not self.internal_ssl:
            return
        from gpulab.hub.service import SERVICE_NAME

        domain = (self.subdomain_hook(SERVICE_NAME, self.domain, kind="service")
                  if self.subdomain_host else "")
        self._service_settings = {**self._service_settings, **service_certificate(
            self.internal_certs_location, self.internal_trust_bundles, self.log, domain)}

    def load_config_file(self, *args, **kwargs):
        super().load_config_file(*args, **kwargs)
        hub = self.config.get("JupyterHub", {})
        file_services = list(hub.get("services", []))
        file_roles = list(hub.get("load_roles", []))
        if self.gpulab_essentials is not None:
            essentials = Config(self.gpulab_essentials)
            # the operator's services and roles are kept beside gpulab's own (and variables
            # the operator gives gpulab's service are added to its environment)
            essentials.JupyterHub.services = _merge_services(
                essentials.JupyterHub.get("services", []), file_services
            )
            essentials.JupyterHub.load_roles = _merge_named(
                essentials.JupyterHub.get("load_roles", []), file_roles
            )
            self.update_config(essentials)
        # the service checks job specs against the limits set in the operator's file, and
        # reconciles notebook allocations as often as it says
        from gpulab.hub.jobs.spec import GPUJobs

        from gpulab.hub.quota.settings import GPULedger

        from gpulab.hub.machine.inventory import GPUInventory

        from gpulab.hub.quota.waiting import GPUQueue

        from gpulab.hub.quota.idle import GPUIdle

        jobs = GPUJobs(config=self.config)
        limits = dataclasses.replace(jobs.limits(),
                                     **person_bounds(self.config, self.spawner_class))
        settings = {**(self.gpulab_service_settings or {}),
                    "job_limits": json.dumps(dataclasses.asdict(limits)),
                    "queue": GPUQueue(config=self.config).settings_json(),
                    "reconcile_seconds": float(GPULedger(config=self.config).reconcile_interval),
                    "usage_seconds": float(GPUInventory(config=self.config).usage_interval),
                    "usage_source": json.dumps(self._usage_settings()),
                    "idle": GPUIdle(config=self.config).settings_json()}
        if jobs.python:
            settings["job_python"] = jobs.python
        self._service_settings = settings

    def _usage_settings(self) -> dict:
        """``c.GPUInventory``'s usage source for the service; the stand-in file defaults to
        ``<data-dir>/gpu-usage.json``."""
        from gpulab.hub.machine.inventory import GPUInventory

        inventory = GPUInventory(config=self.config)
        if inventory.usage_source == "stand-in" and not inventory.usage_stand_in_file:
            data = getattr(self, "gpulab_data_dir", None) or os.getcwd()
            inventory.usage_stand_in_file = os.path.join(str(data), "gpu-usage.json")
            # the hub's own sampler (the spawn form) reads the same file
            GPUInventory.instance(config=self.config).usage_stand_in_file = \
                inventory.usage_stand_in_file
        return inventory.usage_settings()

    def init_services(self):
        from gpulab.hub.service import SERVICE_NAME

        if self.gpulab_service_config is not None and any(
                service.get("name") == SERVICE_NAME for service in self.services):
            # before any service starts; the file holds the ledger's URL: private (0600)
            write_service_config(self.gpulab_service_config, self._service_settings)
        return super().init_services()

    def init_handlers(self):
        super().init_handlers()
        # logging out ends the person's sessions on the hub's side, whatever the authenticator
        # (gpulab.hub.deploy.auth.EndSessionsOnLogout): a copied hub cookie dies with it
        from jupyterhub.handlers.login import LogoutHandler

        from gpulab.hub.deploy.auth import with_session_end

        self.handlers = [
            (spec[0], with_session_end(spec[1]), *spec[2:])
            if isinstance(spec, tuple) and isinstance(spec[1], type)
            and issubclass(spec[1], LogoutHandler) else spec
            for spec in self.handlers]

    async def init_users(self):
        await super().init_users()
        # approved sign-ups that never logged in are hub users too (gpulab.hub.deploy.auth): their
        # quota can be set before their first login
        from gpulab.hub.deploy.auth import GpulabAuthenticator, approved_without_hub_user

        if isinstance(self.authenticator, GpulabAuthenticator):
            from jupyterhub import orm, roles

            for name in approved_without_hub_user(self.db):
                user = orm.User(name=name)
                self.db.add(user)
                roles.assign_default_roles(self.db, entity=user)
                self.log.info("Approved sign-up %s is now a hub user", name)
            self.db.commit()

    async def init_groups(self):
        # With an identity provider that manages groups (gpulab.hub.deploy.oidc), the groups come from
        # each login; gpulab's own group for the first admin would stop the hub (JupyterHub
        # refuses load_groups then). The first admin keeps the gpulab-admin role by name.
        if self.authenticator.manage_groups and self.load_groups:
            self.log.info("Groups come from the identity provider; not loading %s",
                          ", ".join(sorted(self.load_groups)))
            self.load_groups = {}
        return await super().init_groups()

    async def init_spawners(self):
        result = await super().init_spawners()
        # Every server with saved state has now adopted its allocation: any other open
        # notebook allocation in the ledger belongs to a server that is gone (hub crash).
        from gpulab.spawner.mixin import adopted_allocations, hub_ledger

        ledger = hub_ledger(self.config)
        # No start that waited in the GPU queue survived it: those entries leave the line
        # first, so that no pass (the service's) admits one after the orphans are closed
        from gpulab.hub.quota.waiting import Queue

        left = Queue(ledger).forget_notebooks_except(adopted_allocations(),
                                                     "the hub restarted while the server waited")
        if left:
            self.log.info("%d notebook(s) that waited for GPUs left the queue: the hub "
                          "restarted", left)
        ledger.close_orphans("notebook", adopted_allocations(), "server gone at hub start-up")
        return result


def _read_oom_score_adj() -> str:
    try:
        with open("/proc/self/oom_score_adj") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def run_local_hub(settings: LocalSettings, log_level: str = "INFO") -> int:
    data = settings.data
    handler = logging.FileHandler(data.log_dir / "hub.log", encoding="utf8")
    os.chmod(data.log_dir / "hub.log", 0o600)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    config = local_defaults(settings)
    essentials = local_essentials(settings)
    app = GpulabHub.instance(config=config)
    app.extra_log_handlers = [handler]
    app.gpulab_essentials = essentials
    app.gpulab_service_config = data.service_config_file
    app.gpulab_service_settings = gpulab_service_settings(settings)
    # The hub's working directory holds nothing of gpulab's; state lives in the data folder.
    os.chdir(data.path)
    GpulabHub.launch_instance(["-f", str(data.config_file), f"--log-level={log_level.upper()}"])
    from gpulab.hub.service import exit_at_once

    exit_at_once(1 if app.gpulab_service_failed else 0)
    return 0  # (not reached)
