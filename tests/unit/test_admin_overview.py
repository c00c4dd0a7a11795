"""The admin page's audit trail says every field of a quota change (issue 14: GPU-hour
changes were left out), rendered by the service's own template from a real SQLite ledger;
and at organisation scale (issue 40) it lists the hub's people as last read where reading
them all is slow, saying how old the list is, and waits for a fresh read where it is quick."""

import asyncio
import os
import re
from unittest import mock

import pytest
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port

from gpulab.hub.service import app as service
from gpulab.hub.service.hubapi import HubDirectory
from gpulab.hub.service.pages import _pages, page_context
from gpulab.hub.service.quotas import overview
from gpulab.hub.quota.ledger import DeviceInfo, Ledger, Request
from gpulab.hub.quota.policy import Quota


class Directory:  # the hub's user list, as the service reads it from the hub API
    async def users(self):
        return [{"name": "ann", "groups": [], "admin": False}]

    async def users_recent(self):  # read fresh (a small hub)
        return await self.users(), None


def test_audit_trail_shows_gpu_hours_and_unsets(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.migrate()
    ledger.sync_inventory(DeviceInfo(i) for i in range(2))
    ledger.set_quota("user", "ann", Quota(2), actor="admin")
    ledger.set_quota("user", "ann", Quota(2, 1, 100.0, 168), actor="admin")
    ledger.unset_quota("user", "ann", actor="root")

    class Handler:
        pass

    h = Handler()
    h.ledger, h.directory, h.settings = ledger, Directory(), {}
    o = asyncio.run(overview(h))
    ctx = page_context(hub_prefix="/hub/", service_prefix="/services/gpulab/",
                               model={"name": "admin", "admin": True}, xsrf="x", admin=True)
    page = _pages.get_template("admin.html").render(o=o, **ctx)
    rows = page[page.index('<table id="audit"'):]
    assert ('<td class="old">2 GPUs at once</td><td class="new">2 GPUs at once, at most 1 per '
            'request, 100 GPU-hours per') in rows
    assert '<td class="new">unset</td>' in rows and '<td class="old">—</td>' in rows


def test_effective_quotas_as_the_admin_page_refreshes_them(tmp_path):
    """``GET quotas/effective`` (what the page reads after a save, issue 37): each person's
    effective quota in the words of the "Effective quota" column, people with an override
    the hub no longer lists included; the audit in words (``GET audit``)."""
    from gpulab.hub.service.quotas import audit_view, effective_view, known_names

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.migrate()
    ledger.set_quota("default", "", Quota(2), actor="admin")
    ledger.set_quota("group", "staff", Quota(3), actor="admin")
    ledger.set_quota("user", "gone", Quota(1), actor="admin")
    users = [{"name": "ann", "groups": ["staff"], "admin": False},
             {"name": "bob", "groups": [], "admin": False}]
    got = {u["name"]: (u["quota_text"], u["quota_source"]) for u in effective_view(ledger, known_names(ledger, users))}
    assert got == {"ann": ("3 GPUs at once", "group 'staff'"), "bob": ("2 GPUs at once", "default"),
                   "gone": ("1 GPU at once", "user")}
    assert users == [{"name": "ann", "groups": ["staff"], "admin": False},
                     {"name": "bob", "groups": [], "admin": False}]  # the hub's list untouched
    newest = audit_view(ledger, 1)
    assert [(a["scope"], a["name"], a["old_text"], a["new_text"]) for a in newest] == [
        ("user", "gone", "—", "1 GPU at once")]


def test_the_admin_page_has_the_hubs_orange_save_and_an_unset_ready(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.migrate()
    ledger.sync_inventory(DeviceInfo(i, simulated=True) for i in range(2))

    class Handler:
        pass

    h = Handler()
    h.ledger, h.directory, h.settings = ledger, Directory(), {}
    o = asyncio.run(overview(h))
    ctx = page_context(hub_prefix="/hub/", service_prefix="/services/gpulab/",
                       model={"name": "admin", "admin": True}, xsrf="x", admin=True,
                       path="/services/gpulab/admin")
    page = _pages.get_template("admin.html").render(o=o, **ctx)
    assert 'class="btn btn-sm btn-jupyter" type="submit" name="save"' in page
    ours = page[page.index('id="gpulab-page"'):page.index("const API")]  # gpulab's own part
    assert "btn-primary" not in ours
    # ann has no override: her Unset is there, hidden, for the save that makes one
    row = page[page.index("<tr data-user=\"ann\">"):]
    assert 'name="unset" hidden>Unset</button>' in row[:row.index("</tr>")]
    assert '<span class="badge text-bg-warning gpulab-simulated">Simulated</span>' in page
    # the navigation: GPUs, and GPU admin (current), not repeated under Services
    assert 'active" aria-current="page" id="gpulab-admin-nav"' in page
    assert ">Services</a>" not in page


def test_an_admins_queue_actions_are_in_the_audit_trail_in_words():
    """The audit trail also records an admin's hold, release, top and cancel of someone's
    waiting work (scope ``queue``): in words, never read as a quota (that was a 500)."""
    from gpulab.hub.service.quotas import _change_text

    before = {"held": False, "top_at": None, "state": "waiting"}
    assert _change_text("queue", before, "—") == "waiting"
    assert _change_text("queue", {"held": True, "top_at": None, "state": "waiting"}, "—") == "held"
    for action, words in [("hold", "held"), ("release", "released"), ("cancel", "cancelled"),
                          ("top", "moved to the top of the line")]:
        assert _change_text("queue", {"action": action, "held": False, "top_at": None,
                                      "state": "waiting"}, "unset") == words
    assert _change_text("user", {"max_gpus": 2}, "—") == "2 GPUs at once"
    assert _change_text("user", None, "unset") == "unset"


# -- the hub's people as last read, when reading them all is slow (issue 40) --------------

class Clock:
    """A monotonic clock the test moves."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class TimedHub(HubDirectory):
    """The service's own `HubDirectory`, with the hub's paged list of everyone stood in for:
    `people` as the hub lists them now; each full read takes `cost` seconds of the test's
    clock (10,000 people: ~1.8 s) and is counted (`full_reads`)."""

    def __init__(self, people: list[dict], cost: float, many: int = 0):
        super().__init__("http://127.0.0.1:1/hub/api", "unused", many=many, clock=Clock())
        self.people, self.cost = people, cost

    async def _all_users(self, state: str = ""):
        await asyncio.sleep(0)
        self.clock.t += self.cost
        return [dict(u) for u in self.people]


def person(name, *groups):
    return {"name": name, "groups": list(groups), "admin": False}


async def test_a_quick_hub_is_read_fresh_a_slow_one_as_last_read_with_its_age():
    quick = TimedHub([person("ann")], cost=0.01)
    assert await quick.users_recent() == ([person("ann")], None)
    quick.people.append(person("bob"))
    quick.clock.t += 6  # past the ttl: read again, waited for (a new person shows at once)
    users, age = await quick.users_recent()
    assert [u["name"] for u in users] == ["ann", "bob"] and age is None
    assert quick.full_reads == 2
    quick.people.append(person("cyd"))  # within the ttl too: the page reads the hub now
    users, age = await quick.users_recent()
    assert [u["name"] for u in users] == ["ann", "bob", "cyd"] and quick.full_reads == 3
    assert [u["name"] for u in await quick.users()] == ["ann", "bob", "cyd"]  # (the ttl's)
    assert quick.full_reads == 3

    slow = TimedHub([person("ann")], cost=1.8)
    assert (await slow.users_recent())[1] is None  # the first read is waited for
    slow.people.append(person("bob"))
    slow.clock.t += 6
    # past the ttl: everyone who asks meanwhile gets the list as last read, and its age,
    # while one read of the hub goes on in the background
    got = await asyncio.gather(*(slow.users_recent() for _ in range(5)))
    assert all([u["name"] for u in users] == ["ann"] and age == pytest.approx(7.8)
               for users, age in got)
    await slow._refresh
    assert slow.full_reads == 2
    users, age = await slow.users_recent()
    assert [u["name"] for u in users] == ["ann", "bob"] and age == pytest.approx(1.8)
    # a quota saved (`forget`): the next read is due, the list is still served meanwhile
    slow.forget()
    assert [u["name"] for u in (await slow.users_recent())[0]] == ["ann", "bob"]
    await slow._refresh
    assert slow.full_reads == 3

    # slow but small (a loaded machine, a hub of a few hundred people): read fresh, waited for
    few = TimedHub([person("ann")], cost=1.8, many=1000)
    await few.users_recent()
    few.people.append(person("bob"))
    few.clock.t += 6
    users, age = await few.users_recent()
    assert [u["name"] for u in users] == ["ann", "bob"] and age is None and few.full_reads == 2


PREFIX = "/services/gpulab/"
ADMIN = {"kind": "user", "name": "root", "admin": True,
         "scopes": [service.ACCESS_SCOPE, service.ADMIN_SCOPE]}


@pytest.fixture
async def admin_page(tmp_path):
    """The service's admin page over HTTP in this process (who asks: an admin, the hub's
    token check replaced), on a real SQLite ledger; ``serve(directory)``."""
    env = {"JUPYTERHUB_API_TOKEN": "x", "JUPYTERHUB_API_URL": "http://127.0.0.1:1/hub/api",
           "JUPYTERHUB_CLIENT_ID": "service-gpulab", "JUPYTERHUB_SERVICE_PREFIX": PREFIX}
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.migrate()
    ledger.sync_inventory(DeviceInfo(i) for i in range(2))
    # someone the hub no longer lists still holds a GPU
    ledger.admit(Request("left-the-lab", "notebook", "nb", 1))
    servers = []

    async def get_user(self, handler, *, sync=True):
        return ADMIN

    with mock.patch.dict(os.environ, env), \
            mock.patch.object(service.HubOAuth, "get_user", get_user):
        def serve(directory):
            sock, port = bind_unused_port()
            server = HTTPServer(service.make_app(ledger, PREFIX, "/hub/", directory))
            server.add_sockets([sock])
            servers.append(server)

            async def get(query=""):
                r = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}{PREFIX}admin{query}")
                return r.body.decode()
            return get

        yield serve
        for server in servers:
            server.stop()


def names_on(page: str) -> list[str]:
    return re.findall(r'<tr data-user="([^"]+)">', page)


async def test_the_admin_page_of_a_slow_hub_shows_people_as_last_read_and_says_how_old(admin_page):
    hub = TimedHub([person("ann", "vision"), person("bob")], cost=1.8)
    get = admin_page(hub)
    page = await get()
    assert names_on(page) == ["ann", "bob", "left-the-lab"] and 'id="people-read"' not in page
    hub.people.append(person("cyd", "vision"))
    hub.clock.t += 12
    page = await get()  # not waited for: as read 13.8 s ago, and it says so
    assert names_on(page) == ["ann", "bob", "left-the-lab"]
    assert "People as read from the hub 14 s ago" in page
    await hub._refresh  # the newer read, made meanwhile in the background
    page = await get("?q=VISION")  # the newer read, searched by group
    assert names_on(page) == ["ann", "cyd"] and hub.full_reads == 2
    assert names_on(await get("?q=left")) == ["left-the-lab"]  # holds a GPU: still listed


async def test_the_admin_page_of_a_quick_hub_waits_for_a_fresh_read(admin_page):
    hub = TimedHub([person("ann")], cost=0.01)
    get = admin_page(hub)
    assert names_on(await get()) == ["ann", "left-the-lab"]
    hub.people.append(person("bob"))
    hub.clock.t += 6
    page = await get()
    assert names_on(page) == ["ann", "bob", "left-the-lab"] and 'id="people-read"' not in page
    assert hub.full_reads == 2
