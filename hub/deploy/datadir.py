"""The local deployment's data folder: everything `gpulab up` keeps between runs.

::

    <data-dir>/                 0711 (servers' accounts pass through to shared/, no listing)
        jupyterhub.sqlite       0600  the hub database (users, servers, tokens, accounts)
        gpulab.sqlite           0600  the quota ledger
        jupyterhub.pid          0600  the running hub's pid (and proxy.pid, the proxy's)
        cookie_secret           0600  generated once
        proxy_token             0600  generated once
        admin_password          0600  the first admin's generated password
        gpulab_config.py        0600  optional settings for the operator to edit
        gpulab_service_config.json  0600  the gpulab service's settings, written by the hub at
                                      each start (`gpulab.hub.deploy.serviceconfig`)
        logs/                   0700  hub.log and servers/<user>.<server>.log (0600)
        homes/                  0700  servers' homes when users are not isolated
        shared/                 0755  default shared storage (see below)

    <shared-dir>/               0755
        datasets/               0755  readable by everyone, writable by the operator only
        users/                  0711  each user can reach their folder, not list the others
        users/<name>/           0700  owned by the user's account

Every file of the data folder is private to the hub's account from the first start: the files
are made 0600 before anyone opens them (SQLite keeps the mode of an existing database file and
gives its journal and WAL files the database's mode; JupyterHub rewrites the hub's pid file
in place), files of an older installation are made private at each start, and `gpulab up` runs
the hub with umask 077 so that whatever else it writes there is private too.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import stat
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gpulab.hub.deploy.serviceconfig import SERVICE_CONFIG_NAME


class DataDirError(Exception):
    """The data folder or shared folder cannot be used; the message says why and what to do."""


def _ensure_dir(path: Path, mode: int, what: str) -> None:
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        os.chmod(path, mode)
    except OSError as e:
        raise DataDirError(f"Cannot create the {what} {path}: {e.strerror or e}.") from e
    if not path.is_dir():
        raise DataDirError(f"The {what} {path} is not a folder.")
    probe = path / f".gpulab-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise DataDirError(
            f"The {what} {path} is not writable by this account: {e.strerror or e}. "
            "Choose another folder or fix its permissions."
        ) from e


def write_secret(path: Path, value: str) -> None:
    """Write `value` to a new file readable by this account only (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def create_private(path: Path) -> None:
    """Make `path` an existing file readable by this account only (0600), keeping its
    content; a link or other non-file there is refused."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as e:
        raise DataDirError(f"Cannot create {path} privately: {e.strerror or e}.") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DataDirError(f"{path} is not a plain file.")
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def make_private(folder: Path) -> None:
    """chmod go-rwx every plain file directly in `folder` (not following links)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.is_file(follow_symlinks=False):
            mode = entry.stat(follow_symlinks=False).st_mode
            if mode & 0o077:
                os.chmod(entry.path, stat.S_IMODE(mode) & 0o700)


def read_or_create_secret(path: Path, make) -> tuple[str, bool]:
    """The secret stored at `path`, creating it with `make()` first; (value, created)."""
    created = False
    if not path.exists():
        write_secret(path, make())
        created = True
    os.chmod(path, 0o600)
    return path.read_text().strip(), created


@dataclass
class DataDir:
    path: Path
    shared: Path

    @classmethod
    def at(cls, path: str | os.PathLike, shared: str | os.PathLike | None = None) -> "DataDir":
        p = Path(path).expanduser().absolute()
        s = Path(shared).expanduser().absolute() if shared else p / "shared"
        return cls(p, s)

    db_file = property(lambda self: self.path / "jupyterhub.sqlite")
    ledger_file = property(lambda self: self.path / "gpulab.sqlite")
    ledger_url = property(lambda self: f"sqlite:///{self.path / 'gpulab.sqlite'}")
    cookie_secret_file = property(lambda self: self.path / "cookie_secret")
    proxy_token_file = property(lambda self: self.path / "proxy_token")
    admin_password_file = property(lambda self: self.path / "admin_password")
    config_file = property(lambda self: self.path / "gpulab_config.py")
    service_config_file = property(lambda self: self.path / SERVICE_CONFIG_NAME)
    log_dir = property(lambda self: self.path / "logs")
    server_log_dir = property(lambda self: self.path / "logs" / "servers")
    homes_dir = property(lambda self: self.path / "homes")
    hub_pid_file = property(lambda self: self.path / "jupyterhub.pid")
    proxy_pid_file = property(lambda self: self.path / "proxy.pid")

    def prepare(self) -> None:
        """Create the layout (keeping whatever is there) and check that it is writable."""
        _ensure_dir(self.path, 0o711, "data folder")
        for sub, mode in ((self.log_dir, 0o700), (self.server_log_dir, 0o700),
                          (self.homes_dir, 0o700)):
            _ensure_dir(sub, mode, "folder")
        _ensure_dir(self.shared, 0o755, "shared folder")
        _ensure_dir(self.shared / "datasets", 0o755, "datasets folder")
        _ensure_dir(self.shared / "users", 0o711, "users folder")
        # the hub database and the quota ledger (SQLite takes an empty file as a new
        # database), their journals, and the pid files: private before the hub opens them
        for name in ("jupyterhub.sqlite", "gpulab.sqlite"):
            for suffix in ("", "-journal", "-wal", "-shm"):
                path = self.path / (name + suffix)
                if suffix == "" or path.exists():
                    create_private(path)
        # (the proxy's pid file is removed and written anew at each start: umask 077 of
        # `gpulab up` keeps it private)
        create_private(self.hub_pid_file)
        for folder in (self.path, self.log_dir, self.server_log_dir):
            make_private(folder)
        if not self.config_file.exists():
            template = resources.files("gpulab.hub").joinpath("templates/gpulab_config.py")
            write_secret(self.config_file, template.read_text().rstrip("\n"))

    def cookie_secret(self) -> str:
        return read_or_create_secret(self.cookie_secret_file, lambda: secrets.token_hex(32))[0]

    def proxy_token(self) -> str:
        return read_or_create_secret(self.proxy_token_file, lambda: secrets.token_hex(32))[0]

    def admin_password(self) -> tuple[str, bool]:
        """The first admin's password and whether it was generated just now."""
        return read_or_create_secret(self.admin_password_file, lambda: secrets.token_urlsafe(15))

    def check_database(self) -> None:
        """Refuse a database file that is not SQLite (e.g. a stray file) before the hub opens it."""
        if not self.db_file.exists():
            return
        try:
            with sqlite3.connect(f"file:{self.db_file}?mode=ro", uri=True) as con:
                con.execute("select count(*) from sqlite_master").fetchone()
        except sqlite3.DatabaseError as e:
            raise DataDirError(f"{self.db_file} is not a usable SQLite database: {e}.") from e
