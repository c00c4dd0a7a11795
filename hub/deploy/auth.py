"""Login for the local deployment: accounts kept in the hub's own database.

`GpulabAuthenticator` is jupyterhub-nativeauthenticator (sign-up, admin approval, password
change) with one addition: on start it makes sure the first admin's account exists, with the
password that `gpulab up` generated and stored (0600) in the data folder. Nobody else gets in
until an admin approves their sign-up at ``/hub/authorize``.

Its doors, hardened (issues 13.4 and 33):

- **Approval is a POST.** ``/hub/authorize/<name>`` changes nothing on GET (it shows a page
  with a button); the buttons of ``/hub/authorize`` are small forms that POST
  ``action=approve`` or ``action=withdraw`` with the hub's XSRF token, which JupyterHub checks
  on every cookie-authenticated POST. So a link or an image on any page cannot approve a
  sign-up through an admin's cookie. The first admin's approval, and any hub admin's, can
  never be withdrawn (403): that locked the admin out until the database was edited.
  Discarding a sign-up (``/hub/discard/<name>``) is a POST the same way.
- **Guessing is slowed per address, never by locking the victim.** Wrong passwords are
  counted per (address, name) and per address (`gpulab.hub.deploy.throttle`): after
  ``allowed_failed_logins`` wrong passwords for one name from one address, that address waits
  ``login_backoff_seconds`` before its next try for that name, doubling with every further
  miss up to ``seconds_before_next_try``; after ``allowed_failed_logins_per_address`` misses
  from one address (any names) the whole address backs off the same way. The account itself
  is never locked: its owner, from their own address, logs in as always while someone else
  guesses. What is not stopped: a guesser with many addresses (each gets its allowance; bcrypt
  and the password rules are the defence there), and people who share one address with the
  guesser (a NAT, or loopback on the hub's machine) share its backoff.
- **Unknown names cost as much as known ones.** A name with no account is checked against a
  dummy bcrypt hash, and the login page does not hash a second time to tell "not approved
  yet", so the time of a refusal does not tell which names exist.
- **Sign-ups are limited per address.** At most ``signups_per_address_per_hour`` from one
  address, and ``signup_limit_per_hour`` across the hub; past either, /hub/signup answers
  429 saying which.

Password hashes are checked in a thread (bcrypt takes a quarter of a second: on the hub's event
loop a stream of wrong passwords would stall everyone else's requests).

An approved sign-up is a hub user at once (`ApproveHandler`, and `approved_without_hub_user`
for approvals made before this or outside the page): NativeAuthenticator alone makes the hub
user only at the first login, so the admin could not see, or set the GPU quota of, someone
approved who had not logged in yet (admin page, ``gpulab quota set --user``, the hub's admin
panel). Withdrawing an approval keeps the hub user (and its quota): the person cannot log in
either way; deleting the user in the hub's admin panel removes the sign-up too.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import os
from pathlib import Path

import bcrypt
from jupyterhub import orm
from jupyterhub.handlers.login import LogoutHandler
from jupyterhub.user import User
from jupyterhub.utils import new_token
from nativeauthenticator import NativeAuthenticator
from nativeauthenticator.handlers import (AuthorizationAreaHandler, DiscardHandler, LocalBase,
                                          LoginHandler, SignUpHandler, admin_users_scope)
from nativeauthenticator.orm import UserInfo
from tornado import web
from traitlets import Bool, Float, Integer, Unicode

from gpulab.hub.deploy.throttle import Backoff, Window, client_address

#: bcrypt reads at most 72 bytes of a password (bcrypt 5 refuses longer ones)
BCRYPT_MAX_BYTES = 72
#: the address of the sign-up being handled (`SignUpHandler` sets it for `create_user`)
_signup_address: contextvars.ContextVar[str] = contextvars.ContextVar("signup_address",
                                                                      default="unknown")


def _password_bytes(password: str) -> bytes:
    return password.encode("utf-8", "surrogateescape")


class AuthorizationArea(AuthorizationAreaHandler):
    """``/hub/authorize``: the sign-ups, each with buttons that are forms POSTing with the
    hub's XSRF token (``gpulab-authorization-area.html``)."""

    @admin_users_scope
    async def get(self):
        infos = self.db.query(UserInfo).order_by(UserInfo.id).all()
        html = await self.render_template(
            "gpulab-authorization-area.html", ask_email=self.authenticator.ask_email_on_signup,
            users=infos, protected={i.username for i in infos
                                    if self.authenticator.protected_from_withdrawal(i.username)})
        self.finish(html)


class ApproveHandler(LocalBase):
    """``/hub/authorize/<name>``: GET shows what a POST would do and changes nothing; POST
    ``action=approve`` approves the sign-up (and makes the hub user at once), ``action=withdraw``
    withdraws the approval, refused (403) for the first admin and every hub admin."""

    def _sign_up(self, slug: str) -> UserInfo:
        info = UserInfo.find(self.db, self.authenticator.normalize_username(slug))
        if info is None:
            raise web.HTTPError(404, "No sign-up named %r.", slug)
        return info

    @admin_users_scope
    async def get(self, slug):
        info = self._sign_up(slug)
        action = "withdraw" if info.is_authorized else "approve"
        html = await self.render_template(
            "gpulab-authorize-confirm.html", person=info.username, action=action,
            target=self.hub.base_url + "authorize/" + info.username,
            question=(f"Withdraw the approval of {info.username}? They could not log in "
                      "any more." if info.is_authorized else
                      f"Approve the sign-up of {info.username}? They could log in and start "
                      "servers."),
            button="Unauthorize" if info.is_authorized else "Authorize",
            refused=(self.authenticator.protected_from_withdrawal(info.username)
                     if info.is_authorized else ""))
        self.finish(html)

    @admin_users_scope
    async def post(self, slug):
        action = self.get_body_argument("action", "")
        if action not in ("approve", "withdraw"):
            raise web.HTTPError(400, "Say what to do: action=approve or action=withdraw.")
        info = self._sign_up(slug)
        if action == "withdraw":
            refused = self.authenticator.protected_from_withdrawal(info.username)
            if refused:
                raise web.HTTPError(403, "%s", refused)
            if info.is_authorized:
                info.is_authorized = False
                self.db.commit()
                self.log.info("Approval of %s withdrawn by %s", info.username,
                              self.current_user.name)
        else:
            if not info.is_authorized:
                info.is_authorized = True
                self.db.commit()
                self.log.info("Sign-up of %s approved by %s", info.username,
                              self.current_user.name)
            if self.find_user(info.username) is None:
                self.user_from_username(info.username)  # a hub user, never logged in
                self.log.info("Approved %s: hub user created (quota settable before first "
                              "login)", info.username)
        self.redirect(self.hub.base_url + "authorize#" + info.username)


class Discard(DiscardHandler):
    """``/hub/discard/<name>``: a POST (with the XSRF token) removes a sign-up not approved;
    GET shows the button and changes nothing."""

    @admin_users_scope
    async def get(self, user_name):
        info = UserInfo.find(self.db, self.authenticator.normalize_username(user_name))
        if info is None:
            raise web.HTTPError(404, "No sign-up named %r.", user_name)
        html = await self.render_template(
            "gpulab-authorize-confirm.html", person=info.username, action="discard",
            target=self.hub.base_url + "discard/" + info.username, button="Discard",
            question=f"Discard the sign-up of {info.username}?",
            refused=(f"{info.username} is approved: withdraw the approval first."
                     if info.is_authorized else ""))
        self.finish(html)

    @admin_users_scope
    async def post(self, user_name):
        info = UserInfo.find(self.db, self.authenticator.normalize_username(user_name))
        if info is None:
            raise web.HTTPError(404, "No sign-up named %r.", user_name)
        if info.is_authorized:
            raise web.HTTPError(409, "%s is approved: withdraw the approval before "
                                "discarding the sign-up.", info.username)
        self.authenticator.delete_user(type("User", (), {"name": info.username}))
        if self.users.get(info.username) is not None:  # a hub user too: remove it
            self.users.delete(info.username)
        self.log.info("Sign-up of %s discarded by %s", info.username, self.current_user.name)
        self.redirect(self.hub.base_url + "authorize")


class Login(LoginHandler):
    """``/hub/login``: one bcrypt check per try, whatever the name (the handler of
    NativeAuthenticator hashed the password a second time, on the event loop, for names that
    exist), and the refusal `GpulabAuthenticator.authenticate` gave (a wrong password, not
    approved yet, or too many tries: 429)."""

    async def post(self):
        data = {arg: self.get_argument(arg, strip=arg == "username")
                for arg in self.request.body_arguments if arg != "_xsrf"}
        data.setdefault("username", "")
        data.setdefault("password", "")
        user = await self.login_user(data)
        if user:
            self._jupyterhub_user = user
            self.redirect(self.get_next_url(user))
            return
        status, error = getattr(self, "_gpulab_refusal", (403, "Invalid username or password."))
        self.set_status(status)
        username = data["username"]
        self.finish(await self._render(login_error=error, username=username[:64]))


class SignUp(SignUpHandler):
    """``/hub/signup``, telling `GpulabAuthenticator.create_user` whose address asks."""

    async def post(self):
        _signup_address.set(client_address(self.request))
        await super().post()


class EndSessionsOnLogout(LogoutHandler):
    """Logging out ends the person's sessions on the hub's side: besides clearing the
    browser's cookies (JupyterHub's own logout, which also deletes the OAuth tokens minted for
    this browser's session), the person's cookie id is renewed, so every hub cookie ever
    issued to them (a copy an attacker took included) is worthless, and the OAuth tokens of
    their other browser sessions (tokens with a session id: those of servers' and services'
    cookies) are deleted too. API tokens the person made on purpose (``/hub/token``, the API)
    carry no session and stay. `gpulab.hub.deploy.localhub.GpulabHub` puts this in front of
    every logout handler."""

    async def default_handle_logout(self):
        user = self.current_user
        await super().default_handle_logout()
        if isinstance(user, User):  # not a service's token
            end_sessions(self.db, user.orm_user)
            self.log.info("Ended every hub session of %s", user.name)


def end_sessions(db, orm_user) -> int:
    """Renew `orm_user`'s cookie id and delete their tokens bound to a browser session;
    returns how many tokens went."""
    orm_user.cookie_id = new_token()
    gone = 0
    for token in db.query(orm.APIToken).filter(orm.APIToken.user_id == orm_user.id,
                                               orm.APIToken.session_id.isnot(None)):
        db.delete(token)
        gone += 1
    db.commit()
    return gone


def with_session_end(handler_class: type) -> type:
    """`handler_class` (a JupyterHub `LogoutHandler`, or an authenticator's subclass of it)
    ending the person's sessions as `EndSessionsOnLogout` does."""
    if issubclass(handler_class, EndSessionsOnLogout):
        return handler_class
    if handler_class is LogoutHandler:
        return EndSessionsOnLogout
    return type(handler_class.__name__, (EndSessionsOnLogout, handler_class), {
        "__doc__": handler_class.__doc__, "__module__": handler_class.__module__})


def end_sessions_at_logout(c) -> None:
    """Make logging out end the person's hub sessions under the stock ``jupyterhub`` app (the
    chart's hub on Kubernetes), whatever authenticator the configuration ``c`` names so far:
    its class is replaced by a subclass of the same name (so ``c.<ItsName>`` settings still
    apply) whose `get_handlers` puts `EndSessionsOnLogout` in front of its logout handler, or
    adds it at ``/logout``; JupyterHub routes an authenticator's handlers before its own.
    `gpulab.hub.deploy.localhub.GpulabHub` does the same for every logout handler of the local
    hub. Idempotent."""
    from jupyterhub.app import JupyterHub

    trait = JupyterHub.class_traits()["authenticator_class"]
    base = trait.validate(None, c.JupyterHub.get("authenticator_class", trait.default_value))
    if not getattr(base, "_gpulab_ends_sessions", False):
        c.JupyterHub.authenticator_class = ending_sessions(base)


def ending_sessions(base: type) -> type:
    """`base` (an Authenticator class) whose logout ends the person's hub sessions."""

    def get_handlers(self, app):
        handlers, routed = [], False
        for spec in base.get_handlers(self, app):
            if (isinstance(spec, tuple) and isinstance(spec[1], type)
                    and issubclass(spec[1], LogoutHandler)):
                spec = (spec[0], with_session_end(spec[1]), *spec[2:])
                routed = routed or spec[0].rstrip("/") == "/logout"
            handlers.append(spec)
        if not routed:
            handlers.append(("/logout", EndSessionsOnLogout))
        return handlers

    return type(base.__name__, (base,), {
        "get_handlers": get_handlers, "_gpulab_ends_sessions": True,
        "__doc__": base.__doc__, "__module__": base.__module__})


def approved_without_hub_user(db) -> list[str]:
    """Names of approved sign-ups that are no hub user yet (`gpulab.hub.deploy.localhub.GpulabHub` makes
    them at start-up)."""
    return sorted(info.username for info in db.query(UserInfo).filter(UserInfo.is_authorized)
                  if orm.User.find(db, info.username) is None)


class GpulabAuthenticator(NativeAuthenticator):
    bootstrap_admin = Unicode(
        "admin",
        help="""Name of the first admin account, created on the first start
        (default ``admin``). ``gpulab up --admin-user`` sets it. Its approval can never be
        withdrawn; one withdrawn before gpulab refused that is restored at the hub's start.
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
        help="""Wrong passwords for one name from one address after which that address
        waits ``login_backoff_seconds`` before it may try that name again, the wait doubling
        with every further wrong password up to ``seconds_before_next_try`` (default 5; 0
        turns the login throttle off). The account is not locked: its owner, from another
        address, logs in as usual. Example: ``c.GpulabAuthenticator.allowed_failed_logins = 10``
        """,
    ).tag(config=True)

    allowed_failed_logins_per_address = Integer(
        30,
        help="""Wrong passwords from one address (any names; an IPv6 client counts by its /64)
        after which that address waits before any login, as for ``allowed_failed_logins``
        (default 30; 0: no limit per address). People behind one NAT share this allowance.
        Example: ``c.GpulabAuthenticator.allowed_failed_logins_per_address = 100``
        """,
    ).tag(config=True)

    login_backoff_seconds = Float(
        15,
        help="""The first wait (seconds) once an address used up its wrong passwords; every
        further wrong password doubles it, up to ``seconds_before_next_try`` (default 15).
        Tries during a wait are refused (429) without checking the password and do not count.
        Example: ``c.GpulabAuthenticator.login_backoff_seconds = 30``
        """,
    ).tag(config=True)

    seconds_before_next_try = Integer(
        300,
        help="""The longest wait (seconds) of the login throttle (default 300): an address
        that keeps guessing gets one try per this many seconds. An address that has not failed
        for an hour (or this, if longer) starts afresh. Example:
        ``c.GpulabAuthenticator.seconds_before_next_try = 900``
        """,
    ).tag(config=True)

    signups_per_address_per_hour = Integer(
        20,
        help="""At most this many sign-ups per hour from one address (an IPv6 client counts
        by its /64; default 20; 0: no limit per address); past it /hub/signup answers 429 to
        that address only, so one client cannot flood the admin's approval list nor use up
        the hub's allowance (``signup_limit_per_hour``) for everyone. Example:
        ``c.GpulabAuthenticator.signups_per_address_per_hour = 50`` (a class behind one NAT)
        """,
    ).tag(config=True)

    signup_limit_per_hour = Integer(
        200,
        help="""At most this many sign-ups per hour across the hub, all addresses together
        (default 200; 0: no limit): the cap against a flood from many addresses; past it
        /hub/signup answers 429 until the hour has passed. Example:
        ``c.GpulabAuthenticator.signup_limit_per_hour = 1000``
        """,
    ).tag(config=True)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ensure_bootstrap_admin()
        cap = max(self.seconds_before_next_try, 1)
        self._by_name = Backoff(self.allowed_failed_logins, self.login_backoff_seconds, cap)
        self._by_address = Backoff(self.allowed_failed_logins_per_address if
                                   self.allowed_failed_logins else 0,
                                   self.login_backoff_seconds, cap)
        self._signups_by_address = Window(self.signups_per_address_per_hour)
        self._signups = Window(self.signup_limit_per_hour)
        # what an unknown name's password is checked against, at the cost of a real hash
        self._dummy_hash = bcrypt.hashpw(os.urandom(16).hex().encode(), bcrypt.gensalt())

    def get_handlers(self, app):
        ours = {r"/authorize": AuthorizationArea, r"/authorize/([^/]*)": ApproveHandler,
                r"/discard/([^/]*)": Discard, r"/login": Login, r"/signup": SignUp}
        return [(path, ours.get(path, handler)) for path, handler in super().get_handlers(app)]

    def protected_from_withdrawal(self, username: str) -> str:
        """Why `username`'s approval may not be withdrawn ('' when it may)."""
        if self.bootstrap_admin and username == self.normalize_username(self.bootstrap_admin):
            return (f"{username} is the hub's first admin, whose approval can never be "
                    "withdrawn: nobody could log in to undo it.")
        hub_user = orm.User.find(self.db, username)
        if username in self.admin_users or (hub_user is not None and hub_user.admin):
            return (f"{username} is a hub admin, whose approval cannot be withdrawn; take "
                    "their admin rights away first (the hub's admin panel).")
        return ""

    async def authenticate(self, handler, data):
        """The name if the password (and second factor) is right and the sign-up approved;
        otherwise None, with the refusal for the login page in ``handler._gpulab_refusal``.
        Every try that reaches the password costs one bcrypt check, known name or not."""
        username = self.normalize_username(data.get("username", ""))
        password = _password_bytes(data.get("password", ""))
        address = client_address(handler.request) if handler is not None else "unknown"
        wait = max(self._by_name.wait((address, username)), self._by_address.wait(address))
        if wait:
            self.log.warning("Login of %s from %s refused: too many wrong passwords (%.0f s "
                             "to wait)", username[:64], address, wait)
            self._refuse(handler, 429, "Too many wrong passwords from your address: try again "
                         f"in {math.ceil(wait)} seconds.")
            return None
        user = self.get_user(username)
        hashed = user.password if user is not None else self._dummy_hash
        # bcrypt reads 72 bytes at most, and bcrypt 5 refuses more: no such password is right
        valid = await asyncio.to_thread(bcrypt.checkpw, password[:BCRYPT_MAX_BYTES], hashed)
        valid = valid and len(password) <= BCRYPT_MAX_BYTES and user is not None
        if valid and user.has_2fa:
            valid = bool(user.is_valid_token(data.get("2fa")))
        if not valid:
            self._by_name.failed((address, username))
            self._by_address.failed(address)
            return None
        self._by_name.succeeded((address, username))
        if not user.is_authorized:
            self._refuse(handler, 403, f"User {username} has not been authorized by an "
                         "administrator yet.")
            return None
        return username

    @staticmethod
    def _refuse(handler, status: int, message: str) -> None:
        if handler is not None:
            handler._gpulab_refusal = (status, message)

    def create_user(self, username, password, **kwargs):
        if len(_password_bytes(password)) > BCRYPT_MAX_BYTES:
            raise web.HTTPError(400, "Passwords are at most 72 bytes long (bcrypt's limit).")
        address = _signup_address.get()
        if self._signups_by_address.full(address):
            self.log.warning("Sign-up of %r from %s refused: %d sign-ups from there in the "
                             "last hour", username[:64], address, self.signups_per_address_per_hour)
            raise web.HTTPError(429, "Too many accounts were requested from your address in "
                                "the last hour; please try again later or ask the hub's admin.")
        if self._signups.full("hub"):
            self.log.warning("Sign-up of %r refused: %d sign-ups in the last hour",
                             username[:64], self.signup_limit_per_hour)
            raise web.HTTPError(429, "Too many accounts were requested in the last hour; "
                                "please try again later or ask the hub's admin.")
        user = super().create_user(username, password, **kwargs)
        if user is not None:
            self._signups_by_address.add(address)
            self._signups.add("hub")
        return user

    def change_password(self, username, new_password):
        if len(_password_bytes(new_password)) > BCRYPT_MAX_BYTES:
            return None  # the page says "not strong enough"; bcrypt would raise
        return super().change_password(username, new_password)

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
        existing = self.get_user(name)
        if existing is not None:
            if not existing.is_authorized:  # un-approved before that was refused (issue 33.4)
                existing.is_authorized = True
                self.db.commit()
                self.log.warning("The first admin %r was not approved (a GET of "
                                 "/hub/authorize/%s did that before gpulab refused it): "
                                 "approved again", name, name)
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
