"""A real PostgreSQL server for the tests: Debian's `postgresql` binaries, a fresh cluster in
a temporary folder, listening on a Unix socket only, stopped and removed afterwards."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def pg_bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise RuntimeError("PostgreSQL's server is missing: apt-get install postgresql "
                           "(scripts/test.sh installs it as root).")
    return Path(found[-1]).parent


class PostgresServer:
    def __init__(self):
        self.bindir = pg_bindir()
        self.dir = Path(tempfile.mkdtemp(prefix="gpulab-pg-"))
        self.data = self.dir / "data"
        self.sock = self.dir / "sock"
        self.port = 5432  # socket file name only: nothing listens on TCP
        self.proc = None
        # PostgreSQL refuses to run as root: use Debian's postgres account then
        self.run_as = "postgres" if os.geteuid() == 0 else None

    def _cmd(self, *args):
        cmd = [str(self.bindir / args[0]), *args[1:]]
        return ["runuser", "-u", self.run_as, "--", *cmd] if self.run_as else cmd

    def start(self) -> "PostgresServer":
        self.sock.mkdir()
        if self.run_as:
            entry = pwd.getpwnam(self.run_as)
            os.chmod(self.dir, 0o755)
            for p in (self.dir, self.sock):
                os.chown(p, entry.pw_uid, entry.pw_gid)
        subprocess.run(self._cmd("initdb", "-D", str(self.data), "-U", "gpulab", "-A", "trust",
                                 "--no-sync", "-E", "UTF8"),
                       check=True, capture_output=True)
        self.log = open(self.dir / "server.log", "ab")
        self.proc = subprocess.Popen(
            self._cmd("postgres", "-D", str(self.data), "-k", str(self.sock), "-h", "",
                      "-c", "fsync=off", "-c", "max_connections=200",
                      "-c", "synchronous_commit=off"),
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("postgres exited: " + (self.dir / "server.log").read_text())
            if (self.sock / f".s.PGSQL.{self.port}").exists():
                r = subprocess.run(self._cmd("pg_isready", "-h", str(self.sock), "-U", "gpulab"),
                                   capture_output=True)
                if r.returncode == 0:
                    break
            time.sleep(0.2)
        else:
            raise TimeoutError("postgres did not start: " + (self.dir / "server.log").read_text())
        return self

    def create_database(self, name: str) -> str:
        subprocess.run(self._cmd("createdb", "-h", str(self.sock), "-U", "gpulab", name),
                       check=True, capture_output=True)
        return self.url(name)

    def url(self, name: str) -> str:
        return f"postgresql+psycopg://gpulab@/{name}?host={self.sock}"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # smart shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
