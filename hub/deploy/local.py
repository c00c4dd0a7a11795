"""The configuration builder: JupyterHub settings for a gpulab deployment.

`local_defaults` holds what an operator may change in ``gpulab_config.py``; `local_essentials`
holds what `gpulab up`'s command line decides (addresses, folders, secrets), applied after
the operator's file so that the command line always wins.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from traitlets.config import Config

from gpulab.hub.deploy.datadir import DataDir
from gpulab.hub.deploy.serviceconfig import service_command

from pathlib import Path

from gpulab.hub.service import ADMIN_SCOPE, SERVICE_NAME

ADMIN_GROUP = "gpulab-admins"
CULLER_SCOPES = ["list:users", "read:users:activity", "read:servers", "delete:servers"]


@dataclass
class LocalSettings:
    data: DataDir
    ip: str = "127.0.0.1"
    port: int = 8000
    hub_port: int = 8081
    proxy_api_port: int = 8001
    service_port: int = 8002
    admin_user: str = "admin"
    idle_timeout: int = 3600
    cull_every: int = 0  # 0: derived from idle_timeout
    chp_command: str = "configurable-http-proxy"
    simulated_gpus: int | None = None
    isolate_users: bool | None = None
    user_prefix: str | None = None
    #: the loopback address notebook servers listen on when the operator turns
    #: ``c.LocalGPUSpawner.ip_per_server`` off; by default every server has an address of its
    #: own (127.1.0.1 and up, `gpulab.spawner.local.server_ip`). Never 127.0.0.1, where the
    #: hub, the proxy's API and the gpulab service listen: servers' certificates name only
    #: their own address, so that no server's certificate (which its user can read) is valid
    #: for those, nor for another user's server
    server_ip: str = "127.0.0.2"
    #: ``JupyterHub.subdomain_host`` (``http://localhost:8000``): the hub on that host, each
    #: person's server on ``<name>.<host>``, each service on ``<service>--service.<host>``, so
    #: that a page a person's server serves runs on an origin of its own, not the hub's
    #: (issue 33.3). '' (default): one origin for all, with `gpulab.hub.deploy.userpages`'s
    #: refusals as the only (partial) guard
    subdomain_host: str = ""


#: the folder below the data folder where the hub keeps its internal CAs and certificates;
#: inside ``tls/`` (0700), as certipy opens up its own store folder (0755) at every write
INTERNAL_SSL_DIR = "tls/internal-ssl"
#: the folder below the data folder with each server's key and certificates (one folder
#: per server that only its account's group may read; see LocalGPUSpawner.move_certs)
SERVER_CERTS_DIR = "server-certs"


def internal_certs_dir(d: DataDir) -> Path:
    return d.path / INTERNAL_SSL_DIR


def server_alt_names(spawner) -> list[str]:
    """The names in a notebook server's certificate: only the address it listens on.

    JupyterHub's default adds ``IP:127.0.0.1`` and ``DNS:localhost``, the addresses of the hub,
    the proxy's API and the gpulab service; as every server's key is readable by its own
    user, such a certificate would let any user stand in for those (the proxy trusts the
    servers' CA). ``c.LocalGPUSpawner.ssl_alt_names_include_local`` is False with this.
    With ``c.LocalGPUSpawner.ip_per_server`` (gpulab up's default) that address is the
    server's own (set before JupyterHub makes the certificate), so a user's certificate is
    not valid for anybody else's server either.
    """
    names = [f"IP:{spawner.ip}"]
    # with subdomain_host (gpulab up --subdomain-host) the proxy reaches the server under the
    # person's own host name (<name>.<host>) and checks the certificate against it
    user = getattr(spawner, "user", None)
    if user is not None and getattr(user, "settings", {}).get("subdomain_host"):
        names.append(f"DNS:{user.domain}")
    return names


def culler_interval(idle_timeout: int) -> int:
    """How often the idle culler looks: a tenth of the timeout, between 5 s and 5 min."""
    return max(5, min(300, idle_timeout // 10))


def local_defaults(s: LocalSettings) -> Config:
    c = Config()
    c.JupyterHub.spawner_class = "gpulab.spawner.LocalGPUSpawner"
    c.JupyterHub.authenticator_class = "gpulab.hub.deploy.auth.GpulabAuthenticator"
    c.JupyterHub.allow_named_servers = True
    c.JupyterHub.named_server_limit_per_user = 5
    c.JupyterHub.cleanup_servers = True
    # Accounts need an admin's approval (NativeAuthenticator checks it at login), so the hub's
    # own allow list does not filter on top of it.
    c.Authenticator.allow_all = True
    c.NativeAuthenticator.open_signup = False
    c.NativeAuthenticator.minimum_password_length = 8
    c.NativeAuthenticator.check_common_password = True
    # the hub's pages get a "GPUs" link to the gpulab service
    c.JupyterHub.template_paths = [str(Path(__file__).parent.parent / "templates" / "jupyterhub")]
    c.Spawner.default_url = "/lab"
    c.Spawner.poll_interval = 10
    c.Spawner.start_timeout = 120
    c.Spawner.http_timeout = 60
    # every server listens on a loopback address of its own, which alone its certificate
    # names (server_alt_names); an operator may turn this off and choose one address for all
    c.LocalGPUSpawner.ip_per_server = True
    c.LocalGPUSpawner.ip = s.server_ip
    return c


def local_essentials(s: LocalSettings) -> Config:
    d = s.data
    c = Config()
    c.JupyterHub.bind_url = f"http://{s.ip}:{s.port}"
    if s.subdomain_host:
        # people's servers and services on hosts of their own: see LocalSettings.subdomain_host
        c.JupyterHub.subdomain_host = s.subdomain_host
        if s.subdomain_host.startswith("https://"):
            # cookies a server's page sets for the parent domain (cookie tossing) cannot
            # stand in for the hub's: __Host- cookies take no Domain (needs HTTPS)
            c.JupyterHub.cookie_host_prefix_enabled = True
    # Internal traffic is mutual TLS (JupyterHub's internal_ssl): the hub, the proxy, the
    # services and every server present certificates of the hub's own CAs and verify each
    # other's, so whoever binds one of their loopback ports after it died gets no token.
    c.JupyterHub.internal_ssl = True
    c.JupyterHub.internal_certs_location = str(internal_certs_dir(d))
    c.LocalGPUSpawner.server_certs_dir = str(d.path / SERVER_CERTS_DIR)
    c.JupyterHub.hub_bind_url = f"https://127.0.0.1:{s.hub_port}"
    c.JupyterHub.db_url = f"sqlite:///{d.db_file}"
    c.JupyterHub.cookie_secret_file = str(d.cookie_secret_file)
    c.JupyterHub.pid_file = str(d.hub_pid_file)
    c.ConfigurableHTTPProxy.api_url = f"https://127.0.0.1:{s.proxy_api_port}"
    c.ConfigurableHTTPProxy.auth_token = d.proxy_token()
    c.ConfigurableHTTPProxy.command = [s.chp_command]
    c.ConfigurableHTTPProxy.pid_file = str(d.proxy_pid_file)
    c.Authenticator.admin_users = {s.admin_user}
    c.GpulabAuthenticator.bootstrap_admin = s.admin_user
    c.GpulabAuthenticator.bootstrap_password_file = str(d.admin_password_file)
    c.GPULedger.db_url = d.ledger_url
    c.LocalGPUSpawner.shared_dir = str(d.shared)
    c.LocalGPUSpawner.home_dir_template = str(d.homes_dir / "{username}")
    c.LocalGPUSpawner.server_log_dir = str(d.server_log_dir)
    # servers reach the service directly, over TLS, verifying its certificate (signed by the
    # hub's CA, which their own CA bundle holds; see gpulab.hub.deploy.localhub.GpulabHub.init_internal_ssl)
    c.LocalGPUSpawner.service_url = f"https://127.0.0.1:{s.service_port}/services/{SERVICE_NAME}/"
    c.LocalGPUSpawner.ssl_alt_names = server_alt_names
    c.LocalGPUSpawner.ssl_alt_names_include_local = False
    if s.isolate_users is not None:
        c.LocalGPUSpawner.isolate_users = s.isolate_users
    if s.user_prefix is not None:
        c.LocalGPUSpawner.system_user_prefix = s.user_prefix
    if s.simulated_gpus is not None:
        c.GPUInventory.simulated_gpus = s.simulated_gpus
    services, roles = gpulab_service(s), gpulab_roles(s.admin_user)
    c.JupyterHub.custom_scopes = {
        ADMIN_SCOPE: {"description": "Manage gpulab's GPU quotas and see everyone's GPU use."},
    }
    c.JupyterHub.load_groups = {ADMIN_GROUP: {"users": [s.admin_user]}}
    if s.idle_timeout > 0:
        every = s.cull_every or culler_interval(s.idle_timeout)
        services.append(
            {
                "name": "idle-culler",
                "command": [
                    sys.executable,
                    "-m",
                    "gpulab.hub.deploy.culler",  # jupyterhub-idle-culler, ending with the hub
                    f"--timeout={s.idle_timeout}",
                    f"--cull-every={every}",
                    # over mutual TLS with the hub's own certificate, verifying the hub
                    "--ssl-enabled=true",
                    f"--internal-certs-location={internal_certs_dir(d)}",
                ],
            }
        )
        roles.append({"name": "idle-culler", "scopes": CULLER_SCOPES, "services": ["idle-culler"]})
    c.JupyterHub.services = services
    c.JupyterHub.load_roles = roles
    return c


def gpulab_service(s: LocalSettings) -> list[dict]:
    """The gpulab service as a hub-managed process, sharing the hub's ledger. Its settings
    are in its config file in the data folder (`gpulab_service_settings`, written by the hub
    at start: `gpulab.hub.deploy.localhub.GpulabHub.init_services`), not in its environment."""
    return [
        {
            "name": SERVICE_NAME,
            "url": f"https://127.0.0.1:{s.service_port}",
            "command": service_command(sys.executable, s.data.service_config_file),
            "oauth_client_allowed_scopes": [ADMIN_SCOPE],
            # not in the hub's "Services" menu: the navigation's "GPUs" (and "GPU admin") lead
            # to it (hub/templates/jupyterhub/page.html)
            "display": False,
            "oauth_no_confirm": True,
        }
    ]


def gpulab_service_settings(s: LocalSettings) -> dict:
    """The service's settings (`gpulab.hub.service.app.GpulabService` traits) that `gpulab up`'s
    command line decides; the hub adds those of the operator's file (job limits, intervals,
    the jobs' Python) and its TLS files."""
    return {
        "ledger_url": s.data.ledger_url,
        "ledger_pool": "local",
        # training jobs run as the same accounts, in the same folders, as notebooks
        "shared_dir": str(s.data.shared),
        "isolate": bool(s.isolate_users),
        "user_prefix": s.user_prefix or "jupyter-",
    }


def gpulab_roles(admin_user: str) -> list[dict]:
    """Who may do what with the gpulab service (JupyterHub RBAC)."""
    return [
        # gpulab admins: the first admin and the members of the group gpulab-admins
        {"name": "gpulab-admin", "description": "Manage GPU quotas, see all GPU use",
         "scopes": [ADMIN_SCOPE, f"access:services!service={SERVICE_NAME}"],
         "users": [admin_user], "groups": [ADMIN_GROUP]},
        # the service reads users and their groups (effective quotas come from groups), and
        # their servers (to close the GPU allocations of servers the hub no longer has), and
        # stops servers whose GPUs sit idle (c.GPUIdle)
        {"name": "gpulab-service", "description": "The gpulab service's own token",
         "scopes": ["list:users", "read:users", "list:groups", "read:groups", "read:servers",
                    "delete:servers"],
         "services": [SERVICE_NAME]},
        # everyone may call the gpulab service for themselves (their own tokens included)
        {"name": "user", "description": "Standard user privileges, and the gpulab service",
         "scopes": ["self", f"access:services!service={SERVICE_NAME}"]},
        # a notebook server's token may call the gpulab service for its user (jobs, quota)
        {"name": "server", "description": "Post activity, reach the gpulab service",
         "scopes": ["users:activity!user", "access:servers!server",
                    f"access:services!service={SERVICE_NAME}"]},
    ]
