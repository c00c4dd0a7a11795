"""The admin page's audit trail says every field of a quota change (issue 14: GPU-hour
changes were left out), rendered by the service's own template from a real SQLite ledger."""

import asyncio

from gpulab.hub.service.pages import _pages, page_context
from gpulab.hub.service.quotas import overview
from gpulab.hub.quota.ledger import DeviceInfo, Ledger
from gpulab.hub.quota.policy import Quota


class Directory:  # the hub's user list, as the service reads it from the hub API
    async def users(self):
        return [{"name": "ann", "groups": [], "admin": False}]


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
