"""The training-job handlers of the gpulab service (``/jobs…``): HTTP only; the job logic
is the configured backend's (`gpulab.hub.jobs`)."""

from __future__ import annotations

import asyncio
import time

from tornado import web

from gpulab.hub.service.base import MAX_BODY, APIHandler, FieldError
from gpulab.hub.service.quotas import _usage

# -- training jobs -------------------------------------------------------------------------


class JobsBase(APIHandler):
    @property
    def backend(self):
        backend = self.settings.get("jobs")
        if backend is None:
            raise web.HTTPError(503, "Training jobs are not configured on this hub.")
        return backend

    def owner(self) -> str:
        """Whose jobs: your own; an admin may name another user with ?user=."""
        who = self.get_query_argument("user", None)
        me = self.current_user["name"]
        if who is None or who == me:
            return me
        if not self.is_gpulab_admin:
            raise web.HTTPError(403, "You may only see and act on your own jobs.")
        return who


class JobsHandler(JobsBase):
    async def get(self):
        offset, limit = self.page_args()
        if self.get_query_argument("all", "") in ("1", "true"):
            self.require_admin()
            me = self.current_user["name"]
            self.send_page("jobs", [for_viewer(v, me) for v in
                                    await asyncio.to_thread(self.backend.list)], offset, limit)
            return
        me = self.current_user["name"]
        self.send_page("jobs", [for_viewer(v, me) for v in
                                await asyncio.to_thread(self.backend.list, self.owner())],
                       offset, limit)

    async def post(self):
        from gpulab.hub.jobs.spec import SpecError, parse_spec

        if self.backend.unavailable:
            raise web.HTTPError(503, self.backend.unavailable)
        limits = self.settings["job_limits"]
        body = self.json_body(limit=limits.max_source_bytes + MAX_BODY)
        try:
            spec = parse_spec(body, limits)
        except SpecError as e:
            raise FieldError(400, e.field, e.message) from None
        me = self.current_user["name"]
        groups = tuple(await self.directory.groups_of(me))
        self.submitting = spec.name  # a refusal names it (`APIHandler`'s one error mapping)
        job = await self.backend.submit(me, groups, spec)
        # 202: accepted, waiting in the GPU queue (its view says where it stands)
        self.send(job, 202 if job["state"] == "Queued" else 201)


def replica_of_pod(job: str, pod: str) -> tuple[str, int] | None:
    """``(role, index)`` of a replica pod of `job` as Kubernetes names it: an Indexed Job's
    ``<job>-<role>-<index>-<suffix>`` or a JobSet's ``<job>-<role>-<job index>-<index>-<suffix>``
    (None: not a replica pod of that job)."""
    if not pod.startswith(job + "-"):
        return None
    parts = pod[len(job) + 1:].split("-")
    if len(parts) < 3 or not parts[-2].isdigit():
        return None
    return parts[0], int(parts[-2])


class JobLeaseHandler(JobsBase):
    """``POST jobs/<name>/lease`` ``{"idle_for": seconds}``: the notebook kernel that holds
    its person's cluster renews the lease that keeps it (`gpulab.hub.jobs.base`, ``lease``);
    the person's own clusters only (an admin stops, never holds, another's)."""

    job_error_field = "name"

    async def post(self, name):
        body = self.json_body() or {}
        if not isinstance(body, dict):
            raise FieldError(400, "idle_for", "The body must be a JSON object.")
        idle = body.get("idle_for", 0)
        if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not (
                0 <= idle < 10**9):
            raise FieldError(400, "idle_for", "idle_for: seconds since a step was last "
                             "dispatched, a number >= 0.")
        me = self.current_user["name"]
        self.send(for_viewer(await self.backend.lease(me, name, float(idle)), me))


def for_viewer(view: dict, viewer: str) -> dict:
    """A job's view as `viewer` may see it: a held cluster's addresses (``cluster``, where
    its servers listen) for its owner only."""
    if "cluster" in view and view.get("user") != viewer:
        view = {k: v for k, v in view.items() if k != "cluster"}
    return view


class JobHandler(JobsBase):
    async def get(self, name):
        job = for_viewer(await self.backend.view(self.owner(), name),
                         self.current_user["name"])
        from gpulab.extensions.contract import FINAL

        usage = _usage(self)
        if usage is not None and job.get("state") not in FINAL:
            for r in job.get("replicas", ()):
                if r.get("devices"):  # how busy the replica's GPUs are now
                    r["usage"] = usage.entries(r["devices"])
            if not any(r.get("devices") for r in job.get("replicas", ())):
                # a counting pool (Kubernetes): the GPUs DCGM sees in the job's pods
                allocs = await asyncio.to_thread(self.ledger.open_allocations, job.get("user"), "job")
                mine = [a for a in allocs if a.holder == name]
                if mine:
                    job["usage"] = usage.entries_for(mine[0])
                    for r in job.get("replicas", ()):  # the JobView's "GPU use" column
                        r["usage"] = [u for u in job["usage"] if replica_of_pod(
                            name, u.get("pod", "")) == (r.get("role"), r.get("index"))]
        self.send(job)


class JobStopHandler(JobsBase):
    async def post(self, name):
        self.send(await self.backend.stop(self.owner(), name, actor=self.current_user["name"]))


class JobLogsHandler(JobsBase):
    """A replica's log from ``offset`` (at most 1 MiB a call) as a terminal shows it (each
    line in its last state after ``\\r`` and ``\\b`` redraws, escape sequences and colours
    gone), from ``from``: the start of the line still open at ``offset``, which the reader's
    own open line is replaced with; ``raw=1``: the bytes as written, from ``offset``. With
    ``follow=1`` waits up to 20 s for more while the job runs. ``offset`` in the answer is
    where to ask next."""

    job_error_field = "name"

    async def get(self, name, replica):
        offset = self.int_arg("offset", 0, 0, 2**62)
        follow = self.get_query_argument("follow", "") in ("1", "true")
        raw = self.get_query_argument("raw", "") in ("1", "true")
        owner = self.owner()
        deadline = time.monotonic() + 20
        while True:
            # the workflow finds the replica, the driver reads its log off the loop
            piece = await self.backend.read_log_text(owner, name, replica, offset, raw=raw)
            if (piece["offset"] > offset or not follow or piece["done"]
                    or time.monotonic() > deadline):
                break
            await asyncio.sleep(0.5)
        self.send(piece)
