"""The configuration builder: JupyterHub settings for a gpulab deployment.

`local_defaults` holds what an operator may change in ``gpulab_config.py``; `local_essentials`
holds what `gpulab up`'s command line decides (addresses, folders, secrets), applied after
the operator's file so that the command line always wins.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from traitlets.config import Config

from .datadir import DataDir

CULLER_SCOPES = ["list:users", "read:users:activity", "read:servers", "delete:servers"]


@dataclass
class LocalSettings:
    data: DataDir
    ip: str = "127.0.0.1"
    port: int = 8000
    hub_port: int = 8081
    proxy_api_port: int = 8001
    admin_user: str = "admin"
    idle_timeout: int = 3600
    cull_every: int = 0  # 0: derived from idle_timeout
    chp_command: str = "configurable-http-proxy"
    simulated_gpus: int | None = None
    isolate_users: bool | None = None
    user_prefix: str | None = None


def culler_interval(idle_timeout: int) -> int:
    """How often the idle culler looks: a tenth of the timeout, between 5 s and 5 min."""
    return max(5, min(300, idle_timeout // 10))


def local_defaults(s: LocalSettings) -> Config:
    c = Config()
    c.JupyterHub.spawner_class = "gpulab.spawner.LocalGPUSpawner"
    c.JupyterHub.authenticator_class = "gpulab.hub.auth.GpulabAuthenticator"
    c.JupyterHub.allow_named_servers = True
    c.JupyterHub.named_server_limit_per_user = 5
    c.JupyterHub.cleanup_servers = True
    # Accounts need an admin's approval (NativeAuthenticator checks it at login), so the hub's
    # own allow list does not filter on top of it.
    c.Authenticator.allow_all = True
    c.NativeAuthenticator.open_signup = False
    c.NativeAuthenticator.minimum_password_length = 8
    c.NativeAuthenticator.check_common_password = True
    c.Spawner.default_url = "/lab"
    c.Spawner.poll_interval = 10
    c.Spawner.start_timeout = 120
    c.Spawner.http_timeout = 60
    return c


def local_essentials(s: LocalSettings) -> Config:
    d = s.data
    c = Config()
    c.JupyterHub.bind_url = f"http://{s.ip}:{s.port}"
    c.JupyterHub.hub_bind_url = f"http://127.0.0.1:{s.hub_port}"
    c.JupyterHub.db_url = f"sqlite:///{d.db_file}"
    c.JupyterHub.cookie_secret_file = str(d.cookie_secret_file)
    c.JupyterHub.pid_file = str(d.hub_pid_file)
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{s.proxy_api_port}"
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
    if s.isolate_users is not None:
        c.LocalGPUSpawner.isolate_users = s.isolate_users
    if s.user_prefix is not None:
        c.LocalGPUSpawner.system_user_prefix = s.user_prefix
    if s.simulated_gpus is not None:
        c.GPUInventory.simulated_gpus = s.simulated_gpus
    services, roles = [], []
    if s.idle_timeout > 0:
        every = s.cull_every or culler_interval(s.idle_timeout)
        services.append(
            {
                "name": "idle-culler",
                "command": [
                    sys.executable,
                    "-m",
                    "jupyterhub_idle_culler",
                    f"--timeout={s.idle_timeout}",
                    f"--cull-every={every}",
                ],
            }
        )
        roles.append({"name": "idle-culler", "scopes": CULLER_SCOPES, "services": ["idle-culler"]})
    c.JupyterHub.services = services
    c.JupyterHub.load_roles = roles
    return c
