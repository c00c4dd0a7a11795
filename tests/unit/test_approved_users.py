"""Approved sign-ups without a hub user (approved before gpulab made the hub user at approval,
or outside /hub/authorize) are found in the hub's own database schema (JupyterHub's ORM,
NativeAuthenticator's table, SQLite); `GpulabHub.init_users` makes them hub users at start.
Approval through the page is tested against a real hub in tests/app/test_pages.py."""

from jupyterhub import orm
from nativeauthenticator.orm import UserInfo

from gpulab.hub.deploy.auth import approved_without_hub_user


def test_only_approved_sign_ups_without_a_hub_user():
    db = orm.new_session_factory("sqlite://")()  # UserInfo shares its Base: table made
    for name, approved in (("ann", True), ("bob", True), ("eve", False)):
        db.add(UserInfo(username=name, password=b"x", is_authorized=approved))
    db.add(orm.User(name="bob"))  # logged in once: a hub user already
    db.commit()
    assert approved_without_hub_user(db) == ["ann"]
