"""Login for the local deployment: accounts kept in the hub's own database.

`GpulabAuthenticator` is jupyterhub-nativeauthenticator (sign-up, admin approval, password
change) with one addition: on start it makes sure the first admin's account exists, with the
password that `gpulab up` generated and stored (0600) in the data folder. Nobody else gets in
until an admin approves their sign-up at ``/hub/authorize``.
"""

from __future__ import annotations

from pathlib import Path

import bcrypt
from nativeauthenticator import NativeAuthenticator
from nativeauthenticator.orm import UserInfo
from traitlets import Bool, Unicode


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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ensure_bootstrap_admin()

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
