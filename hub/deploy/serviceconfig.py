"""The gpulab service's settings as a private config file, for both deployments.

The hub starts the gpulab service as ``python -m gpulab.hub.service --config=<file>``
(`service_command`); the file is a JSON traitlets config, ``{"GpulabService": {...}}``, with
the traits of `gpulab.hub.service.app.GpulabService` that the hub's own settings decide (the
ledger's URL and pool, the job limits, the intervals, the job backend's settings, the TLS
files). `write_service_config` writes it; the local hub (`gpulab.hub.deploy.localhub`) puts it
in the data folder, the Kubernetes hub (`gpulab.hub.deploy.kubernetes`) in a private folder
of its own.

The file may hold the ledger's password: it is created 0600 under a temporary name (never
readable by anyone else, not even for an instant) by the account that runs the hub, and
therefore the service, then renamed over the old one, so that the service never reads half
a file.

Precedence. A trait set in the file wins over the environment variable it replaces
(`gpulab.hub.service.ENV_FALLBACKS`). An operator who sets one of those variables in the
gpulab service's ``environment`` keeps what that did before the file existed: `service_config`
leaves out of the file every trait whose variable is in ``keep_env`` (the Kubernetes builder
passes the operator's ``environment``, which always won there), so the service reads the
operator's value from its environment. The local hub passes nothing: there gpulab's own
settings always won over the operator's ``environment`` (the hub and the service must agree on
the ledger and the shared folder), and they still do.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from gpulab.hub.service import ENV_FALLBACKS

#: the config file's name in the folder the hub writes it to
SERVICE_CONFIG_NAME = "gpulab_service_config.json"
#: the section of the traitlets config the service reads
SECTION = "GpulabService"


def service_command(python: str, config_file: str | os.PathLike) -> list[str]:
    """The command the hub runs the service with."""
    return [python, "-m", "gpulab.hub.service", f"--config={config_file}"]


def service_config(settings: Mapping, *, keep_env: Mapping | None = None) -> dict:
    """The JSON traitlets config for `settings` (``{trait: value}``), as
    ``{"GpulabService": {...}}``, without the traits whose environment variable is set in
    `keep_env` (the operator's environment for the service, which stays in charge of them)
    and without those whose value is None. A name that is not a setting of the service is a
    `ValueError` (a builder's mistake, caught by the tests)."""
    unknown = sorted(set(settings) - set(ENV_FALLBACKS))
    if unknown:
        raise ValueError(f"Not settings of the gpulab service: {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(ENV_FALLBACKS))}.")
    keep_env = keep_env or {}
    return {SECTION: {name: value for name, value in settings.items()
                      if value is not None and ENV_FALLBACKS[name] not in keep_env}}


def write_service_config(path: str | os.PathLike, settings: Mapping, *,
                         keep_env: Mapping | None = None) -> Path:
    """Write `service_config` (``settings``, ``keep_env``) to `path`, private (0600) from the
    moment the file exists, and atomically: a new file beside it, renamed over `path`.
    The folder must be this account's and closed to others' writes (the data folder, or a
    0700 folder). Returns the path."""
    path = Path(path)
    text = json.dumps(service_config(settings, keep_env=keep_env), indent=1, sort_keys=True)
    folder = path.parent
    info = os.stat(folder)
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{folder} must belong to this account and be closed to others' "
                              "writes, to hold the gpulab service's settings.")
    temp = folder / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf8") as f:
            os.fchmod(f.fileno(), 0o600)  # the mode alone, whatever the umask or the folder
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return path


def private_folder(path: str | os.PathLike) -> Path:
    """`path` as a folder of this account's that only it may enter (0700), made if missing;
    a link or a folder of another account there is refused (`PermissionError`)."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise PermissionError(f"{path} is not a folder of this account.")
    os.chmod(path, 0o700)
    return path
