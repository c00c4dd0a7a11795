"""The GPU queue's REST API: who waits for what, where they stand and why, and an admin's
hold, release, move to the top and cancel (each audited).

``GET queue``: the waiting entries in the order of the line (a person sees their own, a gpulab
admin everyone's), each with its place, estimated start, the GPUs ahead of it, how long it has
waited and why it waits. ``POST queue/<id>/<action>``: admins; ``cancel`` of a job's entry
stops the job too (it ends Stopped, with the admin named). A person may ``cancel`` their own
waiting notebook's entry (its start fails with "You left the queue")."""

from __future__ import annotations

import asyncio
import re
import time

from tornado import web

from gpulab.hub.quota.ledger import BadRequest
from gpulab.hub.quota.waiting import ACTIONS, LEFT_REASON
from gpulab.hub.service.base import APIHandler, FieldError, mark_cluster_kinds


ENTRY_ID = re.compile(r"[0-9a-f]{32}")


def entry_view(e, now: float) -> dict:
    view = e.as_dict()
    view["waited_seconds"] = round(max(0.0, now - e.submitted_at), 1)
    return view


class QueueBase(APIHandler):
    @property
    def queue(self):
        jobs = self.settings.get("jobs")
        return getattr(jobs, "queue", None)


class QueueHandler(QueueBase):
    async def get(self):
        queue = self.queue
        offset, limit = self.page_args()
        if queue is None:
            self.send_page("entries", [], offset, limit, enabled=False)
            return
        who = None if self.is_gpulab_admin else self.current_user["name"]
        now = time.time()
        entries = await asyncio.to_thread(queue.entries, who, now)
        total = len(entries)
        views = [entry_view(e, now) for e in entries[offset:offset + limit]]
        await mark_cluster_kinds(self, [], views)
        self.send_page("entries", views, offset, limit, total, enabled=True)


class QueueActionHandler(QueueBase):
    async def post(self, entry_id: str, action: str):
        if action == "cancel" and not self.is_gpulab_admin:
            await self._leave(entry_id)
            return
        self.require_admin()
        if action not in ACTIONS:
            raise FieldError(404, "action", f"Unknown action '{action}'; one of "
                             f"{', '.join(ACTIONS)}.")
        queue = self.queue
        if queue is None:
            raise web.HTTPError(404, "This hub has no GPU queue.")
        if not ENTRY_ID.fullmatch(entry_id):
            raise FieldError(404, "id", "No queue entry with that id.")
        actor = self.current_user["name"]
        try:
            entry = await asyncio.to_thread(queue.act, entry_id, action, actor)
        except BadRequest as e:
            raise FieldError(400, "action", e.message) from None
        if entry is None:
            raise web.HTTPError(404, "No waiting queue entry with that id (it may have "
                                "started or ended meanwhile).")
        if action == "cancel" and entry.kind == "job":  # the job ends too, never left Queued
            await self.settings["jobs"].stop(entry.user, entry.holder, actor=actor)
        self.send(entry_view(entry, time.time()))

    async def _leave(self, entry_id: str) -> None:
        """A person takes their own waiting notebook out of line (its start then fails with
        "You left the queue"); another's entry is not found, and a job leaves the line by
        being stopped."""
        queue = self.queue
        if queue is None:
            raise web.HTTPError(404, "This hub has no GPU queue.")
        if not ENTRY_ID.fullmatch(entry_id):
            raise FieldError(404, "id", "No queue entry with that id.")
        me = self.current_user["name"]
        entry = await asyncio.to_thread(queue.get, entry_id)
        if entry is None or entry.user != me:  # never says whose it is
            raise web.HTTPError(404, "No waiting queue entry of yours with that id.")
        if entry.kind != "notebook":
            raise web.HTTPError(403, "A job leaves the queue when you stop it (gpulab jobs "
                                f"stop {entry.holder}); only admins cancel entries here.")
        entry = await asyncio.to_thread(queue.cancel, entry_id, me, LEFT_REASON)
        if entry is None:
            raise web.HTTPError(404, "Your server no longer waits in the queue (it may have "
                                "started or ended meanwhile).")
        self.send(entry_view(entry, time.time()))
