"""The security tier: attacks on a real `gpulab up`, made as a second real account.

Two people use one hub: ``vic`` (the victim) and ``eve`` (the attacker). Both signed up, were
approved and logged in; as root each has an isolated system account (``<prefix>vic``,
``<prefix>eve``). `Person.sh` runs a shell command as that person's own system account
(``runuser``), with their hub token in ``JUPYTERHUB_API_TOKEN``: what a terminal in their own
notebook server can do. Each test attacks as eve and asserts that the attack fails and that
vic's data, server and GPUs are untouched.

Isolation is root's job (the README documents that a hub not run as root does not isolate
users), so without root the tier is skipped as a whole; with root, machinery an attack needs
that is missing fails the test with the reason.
"""

from __future__ import annotations

import os
import pwd
import subprocess

import pytest

from tests.app.hubctl import Browser
from tests.conftest import PASSWORD

pytestmark = pytest.mark.security


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/security/" in str(item.fspath):
            item.add_marker(pytest.mark.security)
            if os.geteuid() != 0:
                item.add_marker(pytest.mark.skip(
                    reason="isolation needs root (the README: not root, not isolated)"))


class Person(Browser):
    """A logged-in hub user who also has a shell in their own system account."""

    prefix = ""

    @property
    def account(self) -> pwd.struct_passwd:
        return pwd.getpwnam(self.prefix + self.name)

    def sh(self, script: str, timeout: float = 60, env: dict | None = None,
           check: bool = False) -> subprocess.CompletedProcess:
        """Run `script` with bash as this person's system account (a terminal of theirs)."""
        acc = self.account
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": acc.pw_dir,
                    "USER": acc.pw_name, "JUPYTERHUB_API_TOKEN": self.token(),
                    "HUB": self.hub.url, **(env or {})}
        r = subprocess.run(["runuser", "-u", acc.pw_name, "--", "bash", "-c", script],
                           capture_output=True, text=True, timeout=timeout, env=full_env,
                           cwd="/")
        if check:
            assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        return r


# `hub` and `admin` are the app tier's (tests/conftest.py): a real `gpulab up` as root with
# four simulated GPUs and its first admin, one per module


def _person(hub, admin, prefix, name) -> Person:
    """`name` signed up, approved, logged in, with a running default server (which made
    their system account)."""
    p = Person(hub, name)
    p.prefix = prefix
    r = p.signup(PASSWORD)
    assert r.status_code == 200, r.text[:300]
    assert admin.approve(name).status_code == 200
    p.login(PASSWORD)
    r = p.start_server()
    assert r.status_code in (201, 202), r.text
    return p


@pytest.fixture(scope="module")
def vic(hub, admin, prefix) -> Person:
    """The victim."""
    return _person(hub, admin, prefix, "vic")


@pytest.fixture(scope="module")
def eve(hub, admin, prefix) -> Person:
    """The attacker."""
    return _person(hub, admin, prefix, "eve")
