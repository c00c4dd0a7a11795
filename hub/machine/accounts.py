"""System accounts and shared-storage folders for per-user isolation (TLJH-style).

When the hub runs as root, every hub user's server runs as its own system account
(``jupyter-<name>``, created on first spawn) and the user's folder on shared storage belongs
to that account with mode 0700. These are blocking helpers; the spawner runs them in a thread.

The hub user -> account / folder / log / control group mapping must be injective: if two hub
users ever mapped to one name, the second would get the first one's account and files. Two
things make sure of it:

- `safe_slug` (KubeSpawner's approach): a name that is already a plain safe name is kept as it
  is; every other name (other characters, too long, or containing the escape marker ``--``)
  becomes a cleaned prefix, ``---`` and a hash. A plain name never contains ``--``, so no
  escaped form equals another user's plain name.
- Hashes can be searched for a collision, so the account also records whom it was made for
  (its GECOS comment, `account_comment`), and `ensure_account` refuses an existing account
  that was made for another hub user or not by gpulab at all; `prepare_user_folder` refuses a
  folder that belongs to another account.
"""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import re
import stat
import subprocess
import threading
from pathlib import Path

MAX_LINUX_USERNAME = 32
#: what a plain (unescaped) name may be: lower-case letters, digits, ``_``, ``-``; never
#: containing ``--``, which marks escaped names
_PLAIN = re.compile(r"[a-z0-9_][a-z0-9_-]*")
_HASH_LENGTH = 8
#: comment names that are recorded as they are; others are recorded as their hash
_PLAIN_COMMENT = re.compile(r"[A-Za-z0-9._@+-]{1,100}")


class AccountError(RuntimeError):
    """A system account or folder could not be prepared; the message says which and why."""


class AccountConflict(AccountError):
    """The account or folder a hub user maps to belongs to someone else: never handed out."""


def safe_slug(name: str, max_length: int | None = None) -> str:
    """A hub name as a file-system, account or control-group name component, injectively.

    ``ann``, ``bob_2``, ``dave-x`` stay as they are. ``carol.x`` -> ``carol-x---<hash>``,
    ``a--b`` -> ``a-b---<hash>``, and a name longer than `max_length` is cut and hashed.
    """
    if "--" not in name and _PLAIN.fullmatch(name) and (max_length is None or len(name) <= max_length):
        return name
    return _hashed_slug(name, max_length)


def _hashed_slug(name: str, max_length: int | None = None) -> str:
    digest = hashlib.sha256(name.encode()).hexdigest()[:_HASH_LENGTH]
    cleaned = re.sub(r"[^a-z0-9_]+", "-", name.lower()).strip("-")
    if max_length is not None:
        room = max_length - 3 - _HASH_LENGTH
        if room < 1:
            raise ValueError(f"no room for a hashed name in {max_length} characters")
        cleaned = cleaned[:room].rstrip("-")
    return f"{cleaned or 'x'}---{digest}"


#: Linux's longest file name (bytes; a slug is ASCII)
NAME_MAX = 255
#: the longest slug of a user's or server's name inside a name made of both (a server's
#: folder, log, control group, private /tmp): two of them and a suffix stay within `NAME_MAX`
MAX_PART = 100


def safe_name(name: str) -> str:
    """A hub user's (or server's) name as one folder or file name component (`safe_slug`,
    within `NAME_MAX`: a longer name is hashed)."""
    return safe_slug(name, NAME_MAX)


def server_slug(name: str, max_length: int | None = MAX_PART) -> str:
    """A server's name as a name component: ``default`` for the default server ('') and
    never for a named server (one named "default" is hashed like any escaped name)."""
    if not name:
        return "default"
    return _hashed_slug(name, max_length) if name == "default" else safe_slug(name, max_length)


def server_stem(user: str, server: str) -> str:
    """``<user>.<server>``: a name for one server of one hub user (its certificates' folder,
    its log), injective (neither slug holds a ``.``), within 201 characters."""
    return f"{safe_slug(user, MAX_PART)}.{server_slug(server)}"


def system_username(prefix: str, name: str) -> str:
    """``prefix + safe_slug(name)`` within Linux's 32 characters (longer names are hashed)."""
    return prefix + safe_slug(name, MAX_LINUX_USERNAME - len(prefix))


def account_comment(hub_user: str) -> str:
    """The GECOS comment that records for which hub user gpulab made an account."""
    if _PLAIN_COMMENT.fullmatch(hub_user):
        return f"gpulab user {hub_user}"
    # ':' ',' newlines and other characters have no place in /etc/passwd (useradd refuses
    # ':' and newlines): their hash, after '=', which no name recorded as it is holds
    return f"gpulab user sha256={hashlib.sha256(hub_user.encode()).hexdigest()}"


def check_account(entry: pwd.struct_passwd, hub_user: str) -> pwd.struct_passwd:
    """`entry` if gpulab made it for `hub_user`; `AccountConflict` otherwise."""
    if entry.pw_uid == 0 or entry.pw_gecos != account_comment(hub_user):
        made_by = (f"for another hub user ({entry.pw_gecos!r})" if entry.pw_gecos.startswith("gpulab user ")
                   else "not by gpulab")
        raise AccountConflict(
            f"the system account {entry.pw_name} exists but was made {made_by}, so it is not "
            f"handed to hub user {hub_user!r}. An admin must remove or rename that account")
    return entry


_account_locks: dict[str, threading.Lock] = {}
_account_locks_guard = threading.Lock()


def account_lock(username: str) -> threading.Lock:
    """One lock per system account, for preparing it (its account and folder) in worker
    threads: one person's servers started at once must not both run ``useradd`` and hand
    out the folder while the other is half-way (a race that refused one of them). Other
    people's starts take other locks."""
    with _account_locks_guard:
        return _account_locks.setdefault(username, threading.Lock())


def ensure_account(username: str, hub_user: str) -> pwd.struct_passwd:
    """The system account `username` made for `hub_user` (with home and own group), created
    unless it exists; `AccountConflict` if it exists for anybody else."""
    try:
        return check_account(pwd.getpwnam(username), hub_user)
    except KeyError:
        pass
    cmd = [
        "useradd",
        "--create-home",
        "--user-group",
        "--shell",
        "/bin/bash",
        "--comment",
        account_comment(hub_user),
        username,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        # A concurrent spawn of the same user may have created it meanwhile.
        try:
            return check_account(pwd.getpwnam(username), hub_user)
        except KeyError:
            raise AccountError(
                f"Could not create system account {username}: {result.stderr.strip()}"
            ) from None
    entry = check_account(pwd.getpwnam(username), hub_user)
    os.chmod(entry.pw_dir, 0o700)
    return entry


def delete_account(username: str) -> None:
    """Remove a system account and its home (used by the tests' clean-up). Processes still
    running as it are killed first (userdel refuses an account in use); raises
    `AccountError` if the account is still there afterwards."""
    import psutil

    try:
        uid = pwd.getpwnam(username).pw_uid
    except KeyError:
        uid = None
    if uid is not None:
        left = [p for p in psutil.process_iter(["uids"]) if p.info["uids"]
                and p.info["uids"].real == uid]
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=10)
        r = subprocess.run(["userdel", "--remove", username], capture_output=True, text=True)
        try:
            pwd.getpwnam(username)
        except KeyError:
            pass
        else:
            raise AccountError(f"could not remove the account {username}: {r.stderr.strip()}")
    try:
        grp.getgrnam(username)
    except KeyError:
        return
    subprocess.run(["groupdel", username], capture_output=True)


def prepare_user_folder(folder: Path, owner: pwd.struct_passwd | None) -> Path:
    """Create the user's folder on shared storage, owned by `owner` (None: this process), 0700.

    An existing folder is taken over only from this process's own account (a folder made
    before users were isolated); one that belongs to another account is refused
    (`AccountConflict`), and so is anything that is not a plain folder (a link)."""
    try:
        folder.mkdir(mode=0o700, parents=False, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise AccountError(f"Could not prepare the folder {folder}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):  # pragma: no cover - O_DIRECTORY refuses it
            raise AccountError(f"{folder} is not a folder")
        want = (os.geteuid(), os.getegid()) if owner is None else (owner.pw_uid, owner.pw_gid)
        if st.st_uid != want[0]:
            if st.st_uid != os.geteuid():
                raise AccountConflict(
                    f"the folder {folder} belongs to another account (uid {st.st_uid}), so it "
                    "is not handed out. An admin must move it")
            os.fchown(fd, *want)
        elif st.st_gid != want[1]:
            os.fchown(fd, *want)
        os.fchmod(fd, 0o700)
    except OSError as e:
        raise AccountError(f"Could not prepare the folder {folder}: {e.strerror}") from e
    finally:
        os.close(fd)
    return folder
