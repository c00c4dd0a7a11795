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
