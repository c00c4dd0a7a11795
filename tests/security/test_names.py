"""Every name the hub accepts can start a server and run a job, or is refused at sign-up with
a reason (issue 33 item 7), and one person's servers started at once all start (item 8), on a
real `gpulab up` as root.

Before: a name with a character outside ``[A-Za-z0-9._@+-]`` (``:`` here) got the account
comment ``gpulab user sha256:<hash>``, which useradd refuses, so its spawn answered 500 and its
jobs 403; a name over 59 characters made a certificate common name over 64 (500); and two of
one person's servers started together wrote the same ``user-<name>`` key and certificate in
the hub's store, the first start's move deleting the second's files (500).
"""

from __future__ import annotations

import concurrent.futures
import pwd

import pytest

from gpulab.hub.machine.accounts import account_comment, system_username

from tests.app.hubctl import Browser
from tests.conftest import PASSWORD
from tests.security.test_hostile_input import wait_final
from tests.security.test_servers_isolation import person as approved

pytestmark = pytest.mark.security

#: characters the hub accepts that no account comment may hold (":"), and beyond ASCII
ODD = "dr:wh\u00f6@lab.x+1"
#: the longest name the hub accepts (`GpulabAuthenticator.max_username_length`)
LONG = "l" + "o" * 126 + "g"




@pytest.mark.parametrize("name", [ODD, LONG], ids=["colon", "128-characters"])
def test_a_name_the_hub_accepts_starts_a_server_and_runs_a_job(hub, admin, prefix, name):
    assert len(LONG) == 128
    p = approved(hub, admin, name)
    # a job and a server at once (each makes the account if it is not there yet)
    r = p.service("POST", "jobs", json={
        "name": "hello", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
        "source": "import os; print('ran as', os.getuid(), flush=True)\n"})
    assert r.status_code in (200, 201, 202), r.text
    r = p.start_server()
    assert r.status_code in (201, 202), (r.status_code, r.text[:500])
    # its own account, which records whom it was made for
    account = pwd.getpwnam(system_username(prefix, name))
    assert account.pw_gecos == account_comment(name)
    assert p.run_in_kernel("import os; print(os.getuid())").strip() == str(account.pw_uid)
    view = wait_final(p, "hello")
    assert view["state"] == "Succeeded", view
    log = p.service("GET", "jobs/hello/logs/worker-0").json()["text"]
    assert f"ran as {account.pw_uid}" in log, log
    p.stop_server()


def test_a_longer_name_is_refused_at_sign_up_with_the_reason(hub):
    p = Browser(hub, LONG + "s")
    r = p.signup(PASSWORD)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert "at most 128 characters" in r.text and "this one has 129" in r.text
    # and nothing was made of it
    r = p.post_form("/hub/login", {"username": p.name, "password": PASSWORD},
                    allow_redirects=False)
    assert r.status_code != 302


def test_one_persons_servers_started_at_once_all_start(hub, admin):
    p = approved(hub, admin, "multi")
    servers = ["a", "b", "c"]
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        answers = list(pool.map(lambda s: p.start_server(s, wait=False), servers))
    assert all(r.status_code in (201, 202) for r in answers), [
        (r.status_code, r.text[:300]) for r in answers]
    for s in servers:
        try:
            p.wait_ready(s, timeout=180)
        except TimeoutError:
            raise AssertionError(f"server {s} did not start: {hub.output()[-4000:]}") from None
    # the hub keeps no server's key: each start's own folder in its store is gone
    store = hub.data_dir / "tls" / "internal-ssl"
    assert not list(store.glob("server-*")) and not list(store.glob("user-multi*"))
    # each answers with its own certificate (the hub reaches each through the proxy)
    for s in servers:
        assert s in p.run_in_kernel(f"print('{s}')", server=s)
    for s in servers:
        p.stop_server(s)
