"""System accounts and shared-storage folders for per-user isolation (TLJH-style).

When the hub runs as root, every hub user's server runs as its own system account
(``jupyter-<name>``, created on first spawn) and the user's folder on shared storage belongs
to that account with mode 0700. These are blocking helpers; the spawner runs them in a thread.
"""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import re
import subprocess
from pathlib import Path

MAX_LINUX_USERNAME = 32


class AccountError(RuntimeError):
    """A system account or folder could not be prepared; the message says which and why."""


def safe_name(name: str) -> str:
    """A hub user name as a file-system and account name component.

    Names of lower-case letters, digits, ``_`` and ``-`` are kept as they are; any other name
    gets its other characters replaced and a short hash appended so that two different hub
    users can never map to the same folder or account.
    """
    if re.fullmatch(r"[a-z0-9_][a-z0-9_-]*", name):
        return name
    cleaned = re.sub(r"[^a-z0-9_-]+", "-", name.lower()).strip("-") or "user"
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{cleaned}-{digest}"


def system_username(prefix: str, name: str) -> str:
    """``prefix + name``, shortened with a hash where it would exceed Linux's 32 characters."""
    candidate = prefix + safe_name(name)
    if len(candidate) <= MAX_LINUX_USERNAME:
        return candidate
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return candidate[: MAX_LINUX_USERNAME - 9] + "-" + digest


def ensure_account(username: str, comment: str) -> pwd.struct_passwd:
    """Create the system account `username` (with home and own group) unless it exists."""
    try:
        return pwd.getpwnam(username)
    except KeyError:
        pass
    cmd = [
        "useradd",
        "--create-home",
        "--user-group",
        "--shell",
        "/bin/bash",
        "--comment",
        comment,
        username,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        # A concurrent spawn of the same user may have created it meanwhile.
        try:
            return pwd.getpwnam(username)
        except KeyError:
            raise AccountError(
                f"Could not create system account {username}: {result.stderr.strip()}"
            ) from None
    home = pwd.getpwnam(username).pw_dir
    os.chmod(home, 0o700)
    return pwd.getpwnam(username)


def delete_account(username: str) -> None:
    """Remove a system account and its home (used by the tests' clean-up)."""
    subprocess.run(["userdel", "--remove", username], capture_output=True)
    try:
        grp.getgrnam(username)
    except KeyError:
        return
    subprocess.run(["groupdel", username], capture_output=True)


def prepare_user_folder(folder: Path, owner: pwd.struct_passwd | None) -> Path:
    """Create the user's folder on shared storage, owned by `owner` (None: this process), 0700."""
    try:
        folder.mkdir(mode=0o700, parents=False, exist_ok=True)
        if owner is not None:
            st = folder.stat()
            if (st.st_uid, st.st_gid) != (owner.pw_uid, owner.pw_gid):
                os.chown(folder, owner.pw_uid, owner.pw_gid)
        os.chmod(folder, 0o700)
    except OSError as e:
        raise AccountError(f"Could not prepare the folder {folder}: {e.strerror}") from e
    return folder
