"""The hub's own doors (issues 13.4 and 33): password guessing is slowed per address and
never locks the victim out, a refusal takes as long for a name that exists as for one that
does not, sign-ups are limited per address, none of it stalls the hub for anyone else;
approvals change only through a POST with the hub's XSRF token and never lock an admin out;
logging out kills a copied cookie; the gpulab service's pages cannot be framed by another site.

The clients come from loopback addresses of their own (`tests.app.hubctl.SourceAddress`), as
people at different addresses would: the proxy appends the address it saw to
``X-Forwarded-For``, and that is the address the hub counts."""

from __future__ import annotations

import concurrent.futures
import re
import sqlite3
import statistics
import time

import pytest
import requests

from tests.app.hubctl import Browser
from tests.conftest import PASSWORD, hub_with_config

CONFIG = """
c.GpulabAuthenticator.signups_per_address_per_hour = 3
c.GpulabAuthenticator.signup_limit_per_hour = 9
c.GpulabAuthenticator.allowed_failed_logins_per_address = 8
"""


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    yield from hub_with_config(workdir, prefix, CONFIG, gpus=0)


def _login(hub, name, password, source=None, headers=None) -> requests.Response:
    b = Browser(hub, name, source=source)
    b.s.headers.update(headers or {})  # on every request, that for the XSRF cookie too
    return b.post_form("/hub/login", {"username": name, "password": password},
                       allow_redirects=False)


def _login_status(hub, name, password, source=None) -> int:
    return _login(hub, name, password, source).status_code


def _approved(hub, admin, name, source=None) -> Browser:
    b = Browser(hub, name, source=source)
    assert b.signup(PASSWORD).status_code == 200
    assert admin.approve(name).status_code == 200
    return b


def _is_approved(admin, name) -> bool:
    """Whether the authorization page shows `name`'s sign-up as approved."""
    page = admin.s.get(admin.hub.url + "/hub/authorize").text
    row = re.search(rf'<tr[^>]* id="?{re.escape(name)}"?[ >].*?</tr>', page, re.S)
    assert row, f"no sign-up {name} on the authorization page"
    return "<td>Yes</td>" in row.group(0)


def test_guessing_a_password_slows_the_guesser_not_the_victim_nor_the_hub(hub, admin):
    _approved(hub, admin, "lockvic")
    assert _login_status(hub, "lockvic", PASSWORD) == 302

    # eve guesses vic's password from her address, many times in parallel; meanwhile the
    # admin's API answers
    eve = "127.0.0.66"
    slowest = 0.0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        guesses = [pool.submit(_login_status, hub, "lockvic", f"guess-{i}", eve)
                   for i in range(12)]
        while not all(g.done() for g in guesses):
            t0 = time.monotonic()
            r = admin.api("GET", "/users/admin")
            slowest = max(slowest, time.monotonic() - t0)
            assert r.status_code == 200
        assert all(g.result() != 302 for g in guesses)
    assert slowest < 2.0, f"the hub stalled {slowest:.2f} s while passwords were guessed"

    # eve's address must wait now, even with the right password, and says so
    r = _login(hub, "lockvic", PASSWORD, eve)
    assert r.status_code == 429 and "Too many wrong passwords" in r.text, r.status_code
    # nor does a forwarding header she writes herself make her someone else
    for header in ("X-Forwarded-For", "X-Real-Ip"):
        r = _login(hub, "lockvic", PASSWORD, eve, headers={header: "10.9.8.7"})
        assert r.status_code == 429, header
    # but the account is not locked: vic, from her own address, logs in as always
    assert _login_status(hub, "lockvic", PASSWORD, "127.0.0.67") == 302
    assert _login_status(hub, "lockvic", PASSWORD) == 302
    # and other accounts are not affected
    assert _login_status(hub, "admin", hub.admin_password) == 302


def test_an_address_spraying_passwords_over_many_names_backs_off(hub, admin):
    eve = "127.0.0.68"
    for i in range(8):  # allowed_failed_logins_per_address, one try per name
        assert _login_status(hub, f"name{i}", "guess", eve) != 302
    r = _login(hub, "admin", "guess", eve)
    assert r.status_code == 429 and "Too many wrong passwords" in r.text
    assert _login_status(hub, "admin", hub.admin_password, "127.0.0.69") == 302


def test_a_refusal_takes_as_long_for_a_name_that_does_not_exist(hub, admin):
    """bcrypt costs a quarter of a second: a name without an account used to be refused at
    once (0.02 s against 0.54 s), which told anyone which names exist."""
    known, unknown = [], []
    sources = ["127.0.0.70", "127.0.0.71", "127.0.0.72", "127.0.0.73"]
    for i in range(8):  # interleaved, so that the machine's load falls on both alike
        for name, times in (("admin", known), (f"nobody{i}", unknown)):
            t0 = time.monotonic()
            assert _login_status(hub, name, "wrong-password", sources[i % 4]) != 302
            times.append(time.monotonic() - t0)
    k, u = statistics.median(known), statistics.median(unknown)
    assert u > 0.6 * k, f"known name {k:.3f} s, unknown name {u:.3f} s"


def test_approvals_change_only_by_a_post_with_the_xsrf_token(hub, admin):
    pending = Browser(hub, "pendy", source="127.0.0.90")
    assert pending.signup(PASSWORD).status_code == 200
    assert not _is_approved(admin, "pendy")
    # a page elsewhere makes the admin's browser GET the old toggle links (an image, a link):
    # nothing changes, whatever the admin's cookie
    for path in ("/hub/authorize/pendy", "/hub/authorize/admin", "/hub/discard/pendy"):
        r = admin.s.get(hub.url + path, allow_redirects=False)
        assert r.status_code == 200 and 'id="gpulab-confirm"' in r.text, (path, r.status_code)
    assert not _is_approved(admin, "pendy") and _is_approved(admin, "admin")
    assert "pendy" in admin.s.get(hub.url + "/hub/authorize").text  # not discarded
    # a form on another site POSTs without the token, which it cannot read: refused
    for path, data in (("/hub/authorize/pendy", {"action": "approve"}),
                       ("/hub/authorize/admin", {"action": "withdraw"}),
                       ("/hub/discard/pendy", {})):
        r = admin.s.post(hub.url + path, data=data, allow_redirects=False)
        assert r.status_code == 403 and "_xsrf" in r.text, (path, r.status_code)
    assert not _is_approved(admin, "pendy") and _is_approved(admin, "admin")
    assert _login(hub, "pendy", PASSWORD, "127.0.0.90").status_code == 403
    # eve, approved but no admin, with her own token: refused
    eve = _approved(hub, admin, "doreve", source="127.0.0.91")
    eve.login(PASSWORD)
    assert eve.approve("pendy").status_code == 403
    assert not _is_approved(admin, "pendy")
    # the admin's own POST, with the token, approves (and makes the hub user)
    assert admin.approve("pendy").status_code == 200
    assert _is_approved(admin, "pendy") and admin.api("GET", "/users/pendy").status_code == 200
    assert admin.approve("pendy", "withdraw").status_code == 200
    assert not _is_approved(admin, "pendy")
    r = admin.approve("pendy", "toggle")
    assert r.status_code == 400 and "action=approve or action=withdraw" in r.text


def test_no_admin_can_be_unapproved(hub, admin):
    r = admin.approve("admin", "withdraw")
    assert r.status_code == 403 and "first admin" in r.text, r.status_code
    # another hub admin neither
    _approved(hub, admin, "deputy", source="127.0.0.92")
    assert admin.api("PATCH", "/users/deputy", json={"admin": True}).status_code == 200
    r = admin.approve("deputy", "withdraw")
    assert r.status_code == 403 and "hub admin" in r.text
    assert _is_approved(admin, "admin") and _is_approved(admin, "deputy")
    assert _login_status(hub, "admin", hub.admin_password, "127.0.0.93") == 302
    assert _login_status(hub, "deputy", PASSWORD, "127.0.0.93") == 302


def test_a_copied_cookie_dies_at_logout(hub, admin):
    vic = _approved(hub, admin, "cookievic", source="127.0.0.94")
    vic.login(PASSWORD)
    assert vic.api("GET", "/user").json()["name"] == "cookievic"
    # eve copies vic's cookies (a shared computer, a stolen cookie jar)
    eve = Browser(hub, "cookievic", source="127.0.0.95")
    eve.s.cookies.update(vic.s.cookies)
    assert eve.api("GET", "/user").status_code == 200
    r = vic.s.get(hub.url + "/hub/logout", allow_redirects=False)
    assert r.status_code == 302
    # logged out: the copy mints no token and reads nothing
    r = eve.api("POST", "/users/cookievic/tokens", json={"note": "eve's"})
    assert r.status_code == 403, (r.status_code, r.text)
    assert eve.api("GET", "/user").status_code == 403
    assert "/hub/login" in eve.s.get(hub.url + "/hub/home", allow_redirects=False) \
        .headers.get("Location", "")
    # vic logs in again as always
    again = Browser(hub, "cookievic", source="127.0.0.94")
    again.login(PASSWORD)
    assert again.api("GET", "/user").json()["name"] == "cookievic"


def test_the_gpulab_services_answers_cannot_be_framed_by_another_site(hub, admin):
    for path in ("", "admin", "no-such-page", "api/v1/openapi.json", "api/v1/me"):
        r = admin.s.get(hub.service_url + path)
        policy = r.headers.get("Content-Security-Policy", "")
        assert "frame-ancestors 'self'" in policy, (path, r.status_code, policy)
    r = requests.get(hub.service_api + "me")  # an error, nobody logged in
    assert r.status_code == 401 and "frame-ancestors 'self'" in r.headers[
        "Content-Security-Policy"]


def test_odd_login_and_sign_up_bodies_get_a_refusal_not_a_500(hub):
    b = Browser(hub, "odd", source="127.0.0.98")
    assert b.post_form("/hub/login", {}, allow_redirects=False).status_code == 403
    assert b.post_form("/hub/login", {"username": "admin"}).status_code == 403
    # bcrypt takes 72 bytes at most (bcrypt 5 raises on more)
    long = "x" * 100
    assert _login_status(hub, "admin", long, "127.0.0.98") == 403
    r = b.post_form("/hub/signup", {"username": "odd", "signup_password": long,
                                    "signup_password_confirmation": long})
    assert r.status_code == 400 and "at most 72 bytes" in r.text


def test_signups_are_limited_per_address_then_across_the_hub(hub, admin):
    """Last in this module: it uses up the hub's sign-ups of the hour."""
    eve = "127.0.0.80"
    codes = [Browser(hub, f"flood{i}", source=eve).signup(PASSWORD).status_code
             for i in range(4)]
    assert codes == [200, 200, 200, 429], codes
    r = Browser(hub, "flood-late", source=eve).signup(PASSWORD)
    assert r.status_code == 429 and "from your address" in r.text
    # nothing was made for a refused sign-up
    assert "flood-late" not in admin.s.get(hub.url + "/hub/authorize").text
    # someone else, elsewhere, can still sign up
    assert Browser(hub, "newcomer", source="127.0.0.81").signup(PASSWORD).status_code == 200
    # the hub-wide cap (9 an hour) still holds against many addresses
    codes = [Browser(hub, f"wide{i}", source=f"127.0.1.{i + 1}").signup(PASSWORD).status_code
             for i in range(9)]
    assert 429 in codes and set(codes[codes.index(429):]) == {429}, codes
    r = Browser(hub, "wide-late", source="127.0.2.1").signup(PASSWORD)
    assert r.status_code == 429 and "Too many accounts were requested in the last hour" in r.text


def test_the_admin_password_is_not_in_gpulab_ups_logged_output(hub):
    """Output that is not a terminal (a log file, a service manager's journal) keeps no
    password: it says where the 0600 file is instead."""
    out = hub.output()
    assert "admin_password" in out and "created the admin account" in out
    assert hub.admin_password not in out


def test_a_first_admin_unapproved_before_the_fix_is_approved_again_at_start(hub, admin):
    """Last in this module: it restarts the hub. A GET of /hub/authorize/admin used to
    un-approve the first admin, who stayed locked out until the database was edited."""
    hub.stop()
    with sqlite3.connect(hub.data_dir / "jupyterhub.sqlite") as db:
        db.execute("UPDATE users_info SET is_authorized = 0 WHERE username = 'admin'")
    db.close()
    hub.start()
    assert _login_status(hub, "admin", hub.admin_password, "127.0.0.99") == 302
    assert "approved again" in hub.output()
