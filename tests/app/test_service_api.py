"""The gpulab service over HTTP against the real hub: who may call what, quotas changed
through the API reaching the next spawn, and bad input refused with the field named."""

import asyncio
import json
import time

import requests
import pytest

from gpulab.hub.quota.ledger import Ledger, Request

pytestmark = pytest.mark.app

ANON, USER, OTHER, ADMIN, NOSCOPE = "anonymous", "user", "other", "admin", "no-scope"

# (method, path, body, {actor: expected status})
MATRIX = [
    ("GET", "me", None, {ANON: 401, NOSCOPE: 403, USER: 200, OTHER: 200, ADMIN: 200}),
    ("GET", "quotas", None, {ANON: 401, NOSCOPE: 403, USER: 403, ADMIN: 200}),
    ("PUT", "quotas/default", {"max_gpus": 4}, {ANON: 401, NOSCOPE: 403, USER: 403, ADMIN: 200}),
    ("GET", "quotas/default", None, {ANON: 401, NOSCOPE: 403, USER: 403, ADMIN: 200}),
    ("PUT", "quotas/users/carl", {"max_gpus": 3},
     {ANON: 401, NOSCOPE: 403, USER: 403, OTHER: 403, ADMIN: 200}),
    ("GET", "quotas/users/carl", None, {ANON: 401, NOSCOPE: 403, USER: 403, ADMIN: 200}),
    ("DELETE", "quotas/users/carl", None, {ANON: 401, NOSCOPE: 403, USER: 403, ADMIN: 204}),
    ("PUT", "quotas/groups/staff", {"max_gpus": 2},
     {ANON: 401, NOSCOPE: 403, USER: 403, ADMIN: 200}),
    ("DELETE", "quotas/groups/staff", None, {ANON: 401, NOSCOPE: 403, USER: 403, ADMIN: 204}),
    ("GET", "allocations", None, {ANON: 401, NOSCOPE: 403, USER: 200, ADMIN: 200}),
    ("GET", "allocations?user=ann", None,
     {ANON: 401, NOSCOPE: 403, USER: 200, OTHER: 403, ADMIN: 200}),
    ("GET", "usage?days=30", None, {ANON: 401, NOSCOPE: 403, USER: 200, ADMIN: 200}),
    ("GET", "audit", None, {ANON: 401, NOSCOPE: 403, USER: 403, ADMIN: 200}),
    ("GET", "quotas/effective", None, {ANON: 401, NOSCOPE: 403, USER: 403, ADMIN: 200}),
]


@pytest.fixture(scope="module")
def actors(users, admin):
    ann = users["ann"]
    r = ann.api("POST", "/users/ann/tokens", json={"note": "no scope", "scopes": ["read:users:name!user"]})
    assert r.status_code == 201, r.text
    return {USER: (ann, None), OTHER: (users["bob"], None), ADMIN: (admin, None),
            NOSCOPE: (ann, r.json()["token"])}


def call(hub, actors, actor, method, path, body):
    if actor == ANON:
        return requests.request(method, hub.service_api + path, json=body)
    who, token = actors[actor]
    return who.service(method, path, token=token, json=body)


@pytest.mark.parametrize("method,path,body,expected", MATRIX,
                         ids=[f"{m} {p}" for m, p, _, _ in MATRIX])
def test_authorization_matrix(hub, actors, method, path, body, expected):
    for actor in (ANON, NOSCOPE, USER, OTHER, ADMIN):
        want = expected.get(actor, expected.get(USER))
        r = call(hub, actors, actor, method, path, body)
        assert r.status_code == want, (actor, method, path, r.status_code, r.text)
        if r.status_code >= 400:
            assert r.json()["message"]  # a message for people, never a bare status


def test_people_see_only_their_own(users, hub):
    ann, bob = users["ann"], users["bob"]
    assert ann.start_server("seen", {"profile": "gpu-1"}).status_code in (201, 202)
    try:
        mine = ann.service("GET", "me").json()
        assert [h["name"] for h in mine["holdings"]] == ["seen"]
        theirs = bob.service("GET", "me").json()
        assert theirs["user"] == "bob" and theirs["holdings"] == []
        assert {a["user"] for a in bob.service("GET", "allocations").json()["allocations"]} <= {"bob"}
        usage = bob.service("GET", "usage").json()
        assert set(usage["users"]) <= {"bob"} and usage["groups"] == {}
    finally:
        ann.stop_server("seen")


def test_a_token_revoked_in_the_hub_stops_working_at_the_service_within_seconds(users, hub):
    """The service keeps the hub's answer for a token 5 s (its `HubOAuth`), not the 300 s of
    JupyterHub's process-wide default: a leaked token that its owner revokes is refused by
    the service seconds later, as by the hub at once."""
    carl = users["carl"]
    r = carl.api("POST", "/users/carl/tokens", json={"note": "leaked"})
    assert r.status_code == 201, r.text
    leaked, tid = r.json()["token"], r.json()["id"]
    assert carl.service("GET", "me", token=leaked).status_code == 200  # now in the cache
    assert carl.api("DELETE", f"/users/carl/tokens/{tid}").status_code == 204
    h = {"Authorization": f"token {leaked}"}
    assert requests.get(hub.url + "/hub/api/user", headers=h).status_code == 403
    t0 = time.monotonic()
    while (status := carl.service("GET", "me", token=leaked).status_code) == 200:
        assert time.monotonic() - t0 < 15, "the service still took a revoked token after 15 s"
        time.sleep(0.5)
    took = time.monotonic() - t0
    assert status == 401 and took < 7, (status, took)
    # carl's other token (made before) still works
    assert carl.service("GET", "me").status_code == 200


def test_gpus_of_a_server_the_hub_lost_come_back(users, hub):
    """A hub stopped in the middle of a spawn leaves an allocation whose server it no longer
    has: the service closes it (after the grace for young ones); live servers keep theirs."""
    ann, bob = users["ann"], users["bob"]
    ledger = Ledger(f"sqlite:///{hub.data_dir / 'gpulab.sqlite'}", pool="local")
    assert ann.start_server("live", {"profile": "gpu-1"}).status_code in (201, 202)
    ann.wait_ready("live")
    try:
        # bob's spawn began two minutes ago and the hub never recorded it (crash mid-spawn)
        lost = ledger.admit(Request(user="bob", kind="notebook", holder="default", gpus=1),
                           now=time.time() - 120)
        # and one of a spawn that is just beginning: within the grace, it is kept
        young = ledger.admit(Request(user="bob", kind="notebook", holder="other", gpus=1))
        # (no look at bob's holdings here: the service's pass may close the lost one at any
        # moment from now on, the first look included)
        deadline = time.time() + 30
        while time.time() < deadline and ledger.get(lost.id).open:
            time.sleep(0.5)
        closed = ledger.get(lost.id)
        assert not closed.open and "hub no longer has it" in closed.end_reason
        assert ledger.get(young.id).open
        assert [h["name"] for h in bob.service("GET", "me").json()["holdings"]] == ["other"]
        assert [h["name"] for h in ann.service("GET", "me").json()["holdings"]] == ["live"]
        ledger.release(young.id, "test over")
    finally:
        ann.stop_server("live")


def test_quota_set_by_admin_reaches_the_next_spawn(users, admin, hub):
    carl = users["carl"]
    assert admin.service("PUT", "quotas/users/carl", json={"max_gpus": 1}).status_code == 200
    try:
        # what the admin page shows after a save, without a reload: the effective quota and
        # the audit trail in words
        effective = {u["name"]: u for u in
                     admin.service("GET", "quotas/effective").json()["users"]}
        assert (effective["carl"]["quota_text"], effective["carl"]["quota_source"]) == \
            ("1 GPU at once", "user")
        newest = admin.service("GET", "audit?limit=1").json()["audit"]
        assert [(a["name"], a["new_text"]) for a in newest] == [("carl", "1 GPU at once")]
        r = carl.start_server("", {"profile": "gpu-2"})
        assert r.status_code == 409
        assert "your quota is 1 GPU at once" in r.json()["message"]
        assert carl.service("GET", "me").json()["quota"]["max_gpus"] == 1
        # the spawn form says so too
        assert "Your GPU quota: 1 GPU at once" in carl.s.get(hub.url + "/hub/spawn").text
        assert admin.service("PUT", "quotas/users/carl", json={"max_gpus": 2}).status_code == 200
        assert carl.start_server("", {"profile": "gpu-2"}).status_code in (201, 202)
        me = carl.service("GET", "me").json()
        assert me["gpus_held"] == 2 and me["holdings"][0]["kind"] == "notebook"
        carl.stop_server()
    finally:
        admin.service("DELETE", "quotas/users/carl")
    trail = admin.service("GET", "audit").json()["audit"]
    assert trail[0]["actor"] == "admin" and trail[0]["new"] is None  # the unset
    assert any(t["name"] == "carl" and t["new"] and t["new"]["max_gpus"] == 1 for t in trail)


@pytest.mark.parametrize(
    "body,field",
    [
        ({"max_gpus": -1}, "max_gpus"),
        ({"max_gpus": 0.5}, "max_gpus"),
        ({"max_gpus": 100000}, "max_gpus"),
        ({"max_gpus": 1, "shoe_size": 9}, "shoe_size"),
        ({"max_gpus": 1, "gpu_hours": 10, "window_hours": 0}, "window_hours"),
        ("{not json", "body"),
        ([], "body"),
        ({"max_gpus": 1, "disk": "lots"}, "disk"),
        ({"max_gpus": 1, "disk": "1M"}, "disk"),
        ({"max_gpus": 1, "disk": -5}, "disk"),
    ],
    ids=["negative", "fractional", "absurd", "unknown-field", "zero-window", "malformed-json",
         "not-an-object", "disk-word", "disk-too-small", "disk-negative"],
)
def test_bad_quota_bodies(admin, body, field):
    kw = {"data": body} if isinstance(body, str) else {"json": body}
    r = admin.service("PUT", "quotas/groups/staff", **kw)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field and field in r.json()["message"]
    assert admin.service("GET", "quotas/groups/staff").status_code == 404  # nothing stored


@pytest.mark.parametrize("query,field", [("days=0", "days"), ("days=x", "days"), ("days=9999", "days")])
def test_bad_windows(admin, query, field):
    r = admin.service("GET", "usage?" + query)
    assert r.status_code == 400 and r.json()["field"] == field


def test_unknown_endpoint_is_json_404(admin):
    r = admin.service("GET", "nope")
    assert r.status_code == 404 and "No such gpulab endpoint" in r.json()["message"]


def test_openapi_document_matches_the_handlers(hub, admin):
    from gpulab.hub.service.openapi import openapi_document
    from gpulab.hub.service.app import make_app

    doc = requests.get(hub.service_api + "openapi.json").json()
    assert doc == openapi_document("/services/gpulab/")
    documented = {(p, m.upper()) for p, ops in doc["paths"].items() for m in ops if m != "parameters"}

    import os
    from unittest import mock

    env = {"JUPYTERHUB_API_TOKEN": "x", "JUPYTERHUB_API_URL": "http://127.0.0.1:1/hub/api",
           "JUPYTERHUB_CLIENT_ID": "service-gpulab", "JUPYTERHUB_SERVICE_PREFIX": "/services/gpulab/"}
    with mock.patch.dict(os.environ, env):
        app = make_app(ledger=None, prefix="/services/gpulab/", hub_prefix="/hub/", directory=None)
    routed = set()
    for rule in app.wildcard_router.rules:
        pattern = rule.matcher.regex.pattern.rstrip("$")
        if "/api/v1/" not in pattern:
            continue
        path = pattern.split("/api/v1")[1]
        handler = rule.target
        methods = {m for m in ("GET", "PUT", "POST", "DELETE", "PATCH")
                   if m.lower() in vars(handler)}
        variants = [path.replace("(default)", "default")]
        if "(users|groups)" in path:
            variants = [path.replace("(users|groups)", k) for k in ("users", "groups")]
        for v in variants:
            v = (v.replace("logs/([^/]+)", "logs/{replica}")
                 .replace("queue/([^/]+)/([^/]+)", "queue/{id}/{action}")
                 .replace("([^/]+)", "{name}"))
            routed |= {(v, m) for m in methods}
    assert routed == documented


def gpulab_cli(*args, token, hub):
    import subprocess

    from .hubctl import GPULAB

    return subprocess.run([GPULAB, *args, "--url", hub.url, "--token", token],
                          capture_output=True, text=True, timeout=60)


def test_cli_quota_and_usage(hub, admin, users):
    # a group the hub does not have yet: refused without --force (tests/app/test_client.py)
    r = gpulab_cli("quota", "set", "--group", "students", "--max-gpus", "2",
                   "--gpu-hours", "100", "--window-hours", "168", "--force",
                   token=admin.token(), hub=hub)
    assert r.returncode == 0 and "set group quota students: 2 GPUs at once" in r.stdout, r.stderr
    r = gpulab_cli("quota", "show", "--all", token=admin.token(), hub=hub)
    assert r.returncode == 0
    assert any(line.split()[:3] == ["group", "students", "2"] for line in r.stdout.splitlines())
    r = gpulab_cli("quota", "show", "--all", "--json", token=admin.token(), hub=hub)
    assert {"scope": "group", "name": "students"}.items() <= next(
        q for q in json.loads(r.stdout) if q["name"] == "students").items()
    r = gpulab_cli("quota", "show", token=users["bob"].token(), hub=hub)
    assert r.returncode == 0 and r.stdout.startswith("bob: ")
    # a person without the admin scope is told so, with exit code 1 and no traceback
    r = gpulab_cli("quota", "set", "--user", "bob", "--max-gpus", "8", token=users["bob"].token(), hub=hub)
    assert r.returncode == 1 and "custom:gpulab:admin" in r.stderr and "Traceback" not in r.stderr
    r = gpulab_cli("quota", "set", "--default", "--max-gpus", "-3", token=admin.token(), hub=hub)
    assert r.returncode == 1 and "'max_gpus' must be" in r.stderr
    r = gpulab_cli("usage", "--days", "30", "--json", token=admin.token(), hub=hub)
    assert r.returncode == 0 and json.loads(r.stdout)["days"] == 30
    r = gpulab_cli("quota", "unset", "--group", "students", token=admin.token(), hub=hub)
    assert r.returncode == 0
    r = gpulab_cli("quota", "show", token="not-a-token", hub=hub)
    assert r.returncode == 1 and "HTTP 401" in r.stderr


#: every list API of the service (issue 40): paged, with a bound
LISTS = ["quotas", "quotas/effective", "allocations", "usage", "audit", "jobs", "queue"]


def test_every_list_is_paged_with_a_bound(admin):
    for path in LISTS:
        for query, field in [("limit=0", "limit"), ("limit=1001", "limit"), ("limit=x", "limit"),
                             ("offset=-1", "offset"), ("offset=1.5", "offset")]:
            r = admin.service("GET", f"{path}?{query}")
            assert r.status_code == 400, (path, query, r.status_code, r.text)
            assert r.json()["field"] == field and f"'{field}'" in r.json()["message"], r.text
        if path == "jobs":  # the hub of these tests may run without a job backend
            continue
        page = admin.service("GET", f"{path}?limit=1000").json()["_pagination"]
        assert page["offset"] == 0 and page["limit"] == 1000 and page["next"] is None
        assert admin.service("GET", path).json()["_pagination"]["limit"] in (100, 200)


def test_pages_walk_the_whole_list_and_the_client_follows_them(hub, admin):
    from gpulab.extensions.client import Client

    for n in range(5):
        assert admin.service("PUT", f"quotas/users/pager{n}", json={"max_gpus": n}).status_code == 200
    try:
        whole = admin.service("GET", "quotas?limit=1000").json()
        assert whole["_pagination"]["total"] == len(whole["quotas"]) >= 5
        seen, offset = [], 0
        while True:
            r = admin.service("GET", f"quotas?limit=2&offset={offset}").json()
            assert len(r["quotas"]) <= 2 and r["_pagination"]["total"] == len(whole["quotas"])
            seen += r["quotas"]
            if r["_pagination"]["next"] is None:
                break
            offset = r["_pagination"]["next"]["offset"]
        assert seen == whole["quotas"]
        # past the end: an empty page, not an error
        r = admin.service("GET", f"quotas?offset={len(seen) + 10}").json()
        assert r["quotas"] == [] and r["_pagination"]["next"] is None
        # the client (the CLI's and the widgets') follows `next` to the end
        client = Client(hub_url=hub.url, token=admin.token())
        assert client.request_all("quotas", "quotas", params={"limit": 2}) == whole["quotas"]
        audit = client.request_all("audit", "audit", params={"limit": 3})
        assert len(audit) == admin.service("GET", "audit?limit=1").json()["_pagination"]["total"]
        assert [a["name"] for a in audit[:5]] == [f"pager{n}" for n in range(4, -1, -1)]
        # the admin page's refresh reads the effective quotas of its own page (search: `q`)
        eff = admin.service("GET", "quotas/effective?q=pager&limit=2").json()
        assert [u["name"] for u in eff["users"]] == ["pager0", "pager1"]
        assert eff["_pagination"]["total"] == 5
    finally:
        for n in range(5):
            admin.service("DELETE", f"quotas/users/pager{n}")


def test_the_openapi_document_names_the_pages(hub):
    doc = requests.get(hub.service_api + "openapi.json").json()
    for path in LISTS:
        names = {p["name"] for p in doc["paths"]["/" + path]["get"]["parameters"]}
        assert {"offset", "limit"} <= names, path
        schema = doc["paths"]["/" + path]["get"]["responses"]["200"]["content"][
            "application/json"]["schema"]
        assert "_pagination" in schema["properties"] and "400" in doc["paths"]["/" + path]["get"]["responses"]


def test_the_service_reads_every_page_of_the_hubs_users(hub, admin, users):
    """The hub pages its user list (at most 200 a page): the service's directory reads every
    page (it asked for the bare list once, which the hub cuts at the limit: past 200 people
    it missed everyone else and their servers). Pages of 2 here, as the service reads them."""
    from gpulab.hub.service.hubapi import HubDirectory

    everyone = {u["name"] for u in admin.api("GET", "/users?limit=200").json()}
    assert len(everyone) >= 4  # two pages at least
    ann = users["ann"]
    assert ann.start_server("paged", {"profile": "cpu"}).status_code in (201, 202)
    try:
        d = HubDirectory(hub.url + "/hub/api", admin.token(), page=2)
        assert {u["name"] for u in asyncio.run(d.users())} == everyone
        assert ("ann", "paged") in asyncio.run(d.active_servers())
        # a person's groups without listing everyone
        assert asyncio.run(HubDirectory(hub.url + "/hub/api", admin.token()).groups_of(
            "ann")) == sorted(admin.api("GET", "/users/ann").json()["groups"])
    finally:
        ann.stop_server("paged")
