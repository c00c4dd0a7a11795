"""Login for the local deployment: accounts kept in the hub's own database.

`GpulabAuthenticator` is jupyterhub-nativeauthenticator (sign-up, admin approval, password
change) with one addition: on start it makes sure the first admin's account exists, with the
password that `gpulab up` generated and stored (0600) in the data folder. Nobody else gets in
until an admin approves their sign-up at ``/hub/authorize``.

Hardened against guessing and flooding: an account is locked for `seconds_before_next_try`
after `allowed_failed_logins` wrong passwords in a row (NativeAuthenticator's lockout, on by
default here), sign-ups are limited to `signup_limit_per_hour` across the hub, and password
hashes are checked in a thread (bcrypt takes a quarter of a second: on the hub's event loop a
stream of wrong passwords would stall everyone else's requests).

An approved sign-up is a hub user at once (`ApproveHandler`, and `approved_without_hub_user`
for approvals made before this or outside the page): NativeAuthenticator alone makes the hub
user only at the first login, so the admin could not see, or set the GPU quota of, someone
approved who had not logged in yet (admin page, ``gpulab quota set --user``, the hub's admin
panel). Withdrawing an approval keeps the hub user (and its quota): the person cannot log in
either way; deleting the user in the hub's admin panel removes the sign-up too.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path

import bcrypt
from nativeauthenticator import NativeAuthenticator
from nativeauthenticator.handlers import ToggleAuthorizationHandler, admin_users_scope
from nativeauthenticator.orm import UserInfo
from tornado import web
from traitlets import Bool, Integer, Unicode


class ApproveHandler(ToggleAuthorizationHandler):
    """``/hub/authorize/<name>`` (the Authorize/Unauthorize buttons of ``/hub/authorize``):
    NativeAuthenticator's toggle, and an approval makes the hub user at once."""

    @admin_users_scope
    async def get(self, slug):
        info = UserInfo.find(self.db, self.authenticator.normalize_username(slug))
        if info is None:
            raise web.HTTPError(404, f"No sign-up named '{slug}'.")
        info = UserInfo.change_authorization(self.db, info.username)
        if info.is_authorized and self.find_user(info.username) is None:
            self.user_from_username(info.username)  # a hub user, never logged in
            self.log.info("Approved %s: hub user created (quota settable before first login)",
                          info.username)
        self.redirect(self.hub.base_url + "authorize#" + info.username)


def approved_without_hub_user(db) -> list[str]:
    """Names of approved sign-ups that are no hub user yet (`gpulab.hub.deploy.localhub.GpulabHub` makes
    them at start-up)."""
    from jupyterhub import orm

    return sorted(info.username for info in db.query(UserInfo).filter(UserInfo.is_authorized)
                  if orm.User.find(db, info.username) is None)


class GpulabAuthenticator(NativeAuthenticator):
    bootstrap_admin = Unicode(
        "admin",
        help="""Name of the first admin account, created on the first start
        (default ``admin``). ``gpulab up --admin-user`` sets it.
        """,
    ).tag(config=True)

    bootstrap_password_file = Unicode(
        "",
        help="""File holding the first admin's password (mode 0600). When the admin account
        does not exist yet it is created, authorized, with this password. '' disables it.
        """,
    ).tag(config=True)

    enable_signup = Bool(
        True,
        help="Let people ask for an account at /hub/signup (an admin approves it).",
    ).tag(config=True)

    allowed_failed_logins = Integer(
        5,
        help="""Wrong passwords in a row after which an account is locked for
        ``seconds_before_next_try`` seconds (default 5; 0 turns the lockout off).
        Example: ``c.GpulabAuthenticator.allowed_failed_logins = 10``
        """,
    ).tag(config=True)

    seconds_before_next_try = Integer(
        300,
        help="""How long (seconds) a locked account refuses every login, the right password
        included (default 300). Example: ``c.GpulabAuthenticator.seconds_before_next_try = 900``
        """,
    ).tag(config=True)

    signup_limit_per_hour = Integer(
        20,
        help="""At most this many sign-ups per hour across the hub (default 20; 0: no
        limit); past it /hub/signup refuses new accounts until the hour has passed, so nobody
        can flood the admin's approval list. Example:
        ``c.GpulabAuthenticator.signup_limit_per_hour = 100``
        """,
    ).tag(config=True)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ensure_bootstrap_admin()

    def get_handlers(self, app):
        return [(path, ApproveHandler if path == r"/authorize/([^/]*)" else handler)
                for path, handler in super().get_handlers(app)]

    async def authenticate(self, handler, data):
        username = self.normalize_username(data["username"])
        user = self.get_user(username)
        if not user:
            return None
        if self.allowed_failed_logins and self.is_blocked(username):
            self.log.warning("Login of %s refused: locked after %d wrong passwords", username,
                             self.allowed_failed_logins)
            return None
        hashed = user.password
        valid = await asyncio.to_thread(bcrypt.checkpw, data["password"].encode(), hashed)
        checks = [user.is_authorized, valid]
        if user.has_2fa:
            checks.append(user.is_valid_token(data.get("2fa")))
        if all(checks):
            self.successful_login(username)
            return username
        self.add_login_attempt(username)
        return None

    _signups: deque

    def create_user(self, username, password, **kwargs):
        if self.signup_limit_per_hour:
            recent = self.__dict__.setdefault("_signups", deque())
            now = time.monotonic()
            while recent and recent[0] < now - 3600:
                recent.popleft()
            if len(recent) >= self.signup_limit_per_hour:
                self.log.warning("Sign-up of %r refused: %d sign-ups in the last hour",
                                 username, len(recent))
                raise web.HTTPError(429, "Too many accounts were requested in the last hour; "
                                    "please try again later or ask the hub's admin.")
            user = super().create_user(username, password, **kwargs)
            if user is not None:
                recent.append(now)
            return user
        return super().create_user(username, password, **kwargs)

    max_username_length = Integer(
        128,
        help="""The longest user name (characters) the hub accepts (default 128, what
        NativeAuthenticator's table of sign-ups holds; 0: no limit). A longer name is
        refused at sign-up and user creation with a 400 that says so (hub users made before
        keep theirs). Every shorter name can start servers and jobs: gpulab hashes names
        that do not fit a system account, file or certificate.
        Example: ``c.GpulabAuthenticator.max_username_length = 64``
        """,
    ).tag(config=True)

    def validate_username(self, username):
        if self.max_username_length and len(username) > self.max_username_length:
            from jupyterhub import orm

            if orm.User.find(self.db, username) is not None:  # made before the limit: kept
                return super().validate_username(username)
            raise web.HTTPError(400, f"A user name may have at most {self.max_username_length} "
                                f"characters; this one has {len(username)}. Please choose a "
                                "shorter one.")
        return super().validate_username(username)

    def ensure_bootstrap_admin(self) -> None:
        if not (self.bootstrap_admin and self.bootstrap_password_file):
            return
        name = self.normalize_username(self.bootstrap_admin)
        if self.get_user(name) is not None:
            return
        password = Path(self.bootstrap_password_file).read_text().strip()
        info = UserInfo(
            username=name,
            password=bcrypt.hashpw(password.encode(), bcrypt.gensalt()),
            is_authorized=True,
        )
        self.db.add(info)
        self.db.commit()
        self.log.info("Created the first admin account %r", name)
