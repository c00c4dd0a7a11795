"""Quotas, holdings, usage and the audit trail: the view builders the API and the pages
share (`user_view`, `overview`, `inventory_view`) and the REST handlers ``/me``,
``/quotas…``, ``/allocations``, ``/usage``, ``/audit``. Every ledger read and write runs in a
worker thread, never on the event loop."""

from __future__ import annotations

import asyncio
import time

from tornado import web

from gpulab.hub.quota.ledger import Ledger
from gpulab.hub.quota.policy import Quota, QuotaError, disk_input, parse_quota
from gpulab.hub.service.base import DAY, APIHandler, Base, FieldError, mark_cluster_kinds

# -- views shared by the API and the pages ------------------------------------------------


async def user_view(handler: Base, name: str, now: float | None = None) -> dict:
    """One person's view (the user page, ``/me``); the ledger is read in a worker thread,
    never on the event loop."""
    now = time.time() if now is None else now
    groups = await handler.directory.groups_of(name)
    return await asyncio.to_thread(_user_view, handler.ledger, name, groups, _usage(handler), now)


def _user_view(ledger: Ledger, name: str, groups: list, usage, now: float) -> dict:
    quota, source = ledger.effective(name, groups)
    held = ledger.open_allocations(user=name)
    return {
        "user": name,
        "groups": groups,
        "quota": quota.as_dict() if quota else None,
        "quota_source": source,
        "quota_text": quota.describe() if quota else "no limit but free GPUs",
        "holdings": [_holding(a, usage) for a in held if a.gpus],
        "gpus_held": sum(a.gpus for a in held),
        "usage_gpu_hours": {
            "7d": round(ledger.usage(now - 7 * DAY, now, user=name).get(name, 0.0), 3),
            "30d": round(ledger.usage(now - 30 * DAY, now, user=name).get(name, 0.0), 3),
        },
    }


def _usage(handler: Base):
    """The service's `PoolUsage` (None: GPU usage is not measured by this service)."""
    return handler.settings.get("gpu_usage")


def _holding(a, usage=None) -> dict:
    """One open allocation; with `usage`, how busy each of its devices is now (NVML)."""
    return {"id": a.id, "kind": a.kind, "name": a.holder, "gpus": a.gpus,
            "devices": list(a.devices), "since": a.started_at,
            "usage": usage.entries_for(a) if usage is not None else []}


def inventory_view(ledger: Ledger, usage=None) -> dict:
    devices = ledger.devices()
    held = {i for a in ledger.open_allocations() for i in a.devices}
    return {"total": len(devices), "free": len([d for d in devices if d.index not in held]),
            "simulated": any(d.simulated for d in devices),
            # whether real GPUs' usage is read (NVML on this machine)
            "usage_measured": usage is not None and usage.sampler is not None}


#: the admin page's users per page when the address names no ``limit``
ADMIN_PAGE_USERS = 50


async def overview(handler: Base, search: str = "", offset: int = 0,
                   limit: int = ADMIN_PAGE_USERS) -> dict:
    """Everything the admin page shows: one page of users (``limit`` from ``offset`` of those
    whose name or group holds `search`), groups, default quota, audit trail. The ledger is
    read in a worker thread, never on the event loop. The hub's users as
    `HubDirectory.users_recent` gives them: on a hub whose list is slow to read, as last
    read (``people_read_ago``: how many seconds ago; None: read fresh)."""
    users, age = await handler.directory.users_recent()
    o = await asyncio.to_thread(_overview, handler.ledger, users, _usage(handler), time.time(),
                                search, offset, limit)
    o["people_read_ago"] = age
    return o


def known_names(ledger: Ledger, users: list, search: str = "", extra=()) -> list[dict]:
    """The people the admin page lists, sorted by name: the hub's `users`, and people the hub
    no longer lists but who have a user override or are named in `extra` (they hold GPUs or
    have history); only those whose name or one of whose groups holds `search` (any case)."""
    known = {u["name"] for u in users}
    gone = ({q["name"] for q in ledger.quotas() if q["scope"] == "user"} | set(extra)) - known
    out = [*users, *({"name": n, "groups": [], "admin": False} for n in gone)]
    if search:
        s = search.casefold()
        out = [u for u in out if s in u["name"].casefold()
               or any(s in g.casefold() for g in u["groups"])]
    return sorted(out, key=lambda u: u["name"])


def _overview(ledger: Ledger, users: list, usage, now: float, search: str = "",
              offset: int = 0, limit: int = ADMIN_PAGE_USERS) -> dict:
    open_allocs = ledger.open_allocations()
    models = {d.index: d.model for d in ledger.devices()}
    u7, u30 = ledger.usage_windows((now - 7 * DAY, now - 30 * DAY), now)
    # each row with its disk limit as the admin page's input shows it ("20G": exact)
    rows = {q["scope"] + ":" + q["name"]: {**q, "disk_text": disk_input(q.get("disk"))}
            for q in ledger.quotas()}
    # open allocations by person: one pass, not one scan of them per person
    held: dict[str, list] = {}
    for a in open_allocs:
        if a.gpus:
            held.setdefault(a.user, []).append(a)
    # people the hub no longer lists but who still hold GPUs or have history stay visible
    everyone = known_names(ledger, users, "", {a.user for a in open_allocs} | set(u30))
    listed = everyone
    if search:
        s = search.casefold()
        listed = [u for u in everyone if s in u["name"].casefold()
                  or any(s in g.casefold() for g in u["groups"])]
    # the groups' sums cover everyone (no SQL per person: dictionaries read above)
    groups: dict[str, dict] = {}
    for u in everyone:
        mine = held.get(u["name"], ())
        for g in u["groups"]:
            entry = groups.setdefault(g, {"name": g, "members": [], "gpus_held": 0,
                                          "gpu_hours_7d": 0.0, "gpu_hours_30d": 0.0})
            entry["members"].append(u["name"])
            entry["gpus_held"] += sum(a.gpus for a in mine)
            entry["gpu_hours_7d"] += u7.get(u["name"], 0.0)
            entry["gpu_hours_30d"] += u30.get(u["name"], 0.0)
    # the effective quotas (one read) only for the people on this page
    out_users = []
    page = listed[offset:offset + limit]
    effective = ledger.effective_of({u["name"]: u["groups"] for u in page})
    for u in page:
        quota, source = effective[u["name"]]
        mine = held.get(u["name"], ())
        out_users.append({
            "name": u["name"], "groups": u["groups"],
            "quota": quota.as_dict() if quota else None, "quota_source": source,
            "quota_text": quota.describe() if quota else "no limit",
            "override": rows.get("user:" + u["name"]),
            # which devices, of which models: the admin sees who holds GPU 3
            "holdings": [{**_holding(a, usage), "models": sorted({models[i] for i in a.devices
                                                            if models.get(i)})}
                         for a in mine],
            "gpus_held": sum(a.gpus for a in mine),
            "gpu_hours_7d": round(u7.get(u["name"], 0.0), 2),
            "gpu_hours_30d": round(u30.get(u["name"], 0.0), 2),
        })
    for key, q in rows.items():
        if q["scope"] == "group":
            groups.setdefault(q["name"], {"name": q["name"], "members": [], "gpus_held": 0,
                                          "gpu_hours_7d": 0.0, "gpu_hours_30d": 0.0})
    for g in groups.values():
        g["quota"] = rows.get("group:" + g["name"])
        g["gpu_hours_7d"] = round(g["gpu_hours_7d"], 2)
        g["gpu_hours_30d"] = round(g["gpu_hours_30d"], 2)
    return {
        "users": out_users,
        "users_total": len(listed), "everyone": len(everyone),
        "search": search, "offset": offset, "limit": limit,
        "groups": sorted(groups.values(), key=lambda g: g["name"]),
        "default": rows.get("default:"),
        "inventory": inventory_view(ledger, usage),
        "audit": audit_view(ledger, 50),
    }


def audit_view(ledger: Ledger, limit: int, offset: int = 0) -> list[dict]:
    """The newest `limit` quota changes (after the newest `offset`), each with every field of
    the change (GPU-hours too) in the words of the quota column (``old_text``,
    ``new_text``)."""
    return [{**a, "old_text": _change_text(a["scope"], a["old"], "—"),
             "new_text": _change_text(a["scope"], a["new"], "unset")}
            for a in ledger.audit(limit, offset)]


def audit_page(ledger: Ledger, offset: int, limit: int) -> tuple[list[dict], int]:
    """``(rows, total)``: one page of `audit_view` and how many changes there are."""
    return audit_view(ledger, limit, offset), ledger.audit_count()


#: an admin's action on a waiting entry (`gpulab.hub.quota.waiting`), in words
QUEUE_ACTIONS = {"hold": "held", "release": "released", "top": "moved to the top of the line",
                 "cancel": "cancelled"}


def _change_text(scope: str, value: dict | None, none: str) -> str:
    """One side of an audited change in words: a quota, or a waiting entry's state (scope
    ``queue``: an admin's hold, release, top or cancel)."""
    if not value:
        return none
    if scope == "idle":  # a server or job warned, stopped or kept for idle GPUs
        return str(value.get("text", ""))
    if scope != "queue":
        return Quota(**value).describe()
    if "action" in value:
        return QUEUE_ACTIONS.get(value["action"], value["action"])
    return ("held" if value.get("held") else "waiting") + (
        f" ({value['state']})" if value.get("state") not in (None, "waiting") else "")


def effective_view(ledger: Ledger, users: list) -> list[dict]:
    """The effective quota of each of `users` (the admin page's "Effective quota" column; one
    page of `known_names`)."""
    out = []
    effective = ledger.effective_of({u["name"]: u["groups"] for u in users})
    for u in users:
        quota, source = effective[u["name"]]
        out.append({"name": u["name"], "quota": quota.as_dict() if quota else None,
                    "quota_source": source,
                    "quota_text": quota.describe() if quota else "no limit"})
    return out


# -- REST API ------------------------------------------------------------------------------


class MeHandler(APIHandler):
    async def get(self):
        view = await user_view(self, self.current_user["name"])
        mine = [{**h, "user": view["user"]} for h in view["holdings"]]
        await mark_cluster_kinds(self, mine, [])
        for h, marked in zip(view["holdings"], mine):
            h["kind"] = marked["kind"]
        view["inventory"] = await asyncio.to_thread(inventory_view, self.ledger, _usage(self))
        view["admin"] = self.is_gpulab_admin
        backend = self.settings.get("jobs")
        view["jobs"] = None if backend is None else {
            "backend": backend.name, "images": list(self.settings["job_limits"].allowed_images),
            "available": not backend.unavailable, "reason": backend.unavailable or ""}
        self.send(view)


class QuotasHandler(APIHandler):
    async def get(self):
        self.require_admin()
        offset, limit = self.page_args()
        self.send_page("quotas", await asyncio.to_thread(self.ledger.quotas), offset, limit)


class EffectiveQuotasHandler(APIHandler):
    """``/quotas/effective``: every person's effective quota, as the admin page shows it (it
    reads this after a quota is saved, to show the change without a reload)."""

    async def get(self):
        self.require_admin()
        offset, limit = self.page_args()
        search = self.get_query_argument("q", "")
        users, _age = await self.directory.users_recent()  # as the admin page lists them
        names = await asyncio.to_thread(known_names, self.ledger, users, search)
        page = names[offset:offset + limit]
        self.send_page("users", await asyncio.to_thread(effective_view, self.ledger, page),
                       offset, limit, len(names))


class QuotaHandler(APIHandler):
    """``/quotas/default``, ``/quotas/users/<name>``, ``/quotas/groups/<name>``."""

    def _target(self, kind: str, name: str | None) -> tuple[str, str]:
        self.require_admin()
        scope = {"default": "default", "users": "user", "groups": "group"}[kind]
        name = name or ""
        if scope != "default" and not 1 <= len(name) <= 255:
            raise FieldError(400, "name", f"A {scope} name must have 1 to 255 characters.")
        return scope, name

    async def get(self, kind, name=None):
        scope, name = self._target(kind, name)
        q = await asyncio.to_thread(self.ledger.quota_of, scope, name)
        if q is None:
            raise web.HTTPError(404, f"No {scope} quota is set" + (f" for '{name}'." if name else "."))
        self.send({"scope": scope, "name": name, **q.as_dict()})

    async def put(self, kind, name=None):
        scope, name = self._target(kind, name)
        disks = self.settings.get("disks")
        try:
            quota = parse_quota(self.json_body())
            users = await self.directory.users() if disks is not None else []
            if disks is not None and scope == "user" and name not in {u["name"] for u in users}:
                users = [*users, {"name": name, "groups": await self.directory.groups_of(name)}]
            if disks is not None:
                # a lower limit than somebody's files take is refused before it is stored
                why = await asyncio.to_thread(disks.refusal, scope, name, quota, users)
                if why is not None:
                    raise FieldError(why.status, "disk", why.message)
            # writes wait for the ledger's lock: in a worker thread, never on the event loop
            row = await asyncio.to_thread(self.ledger.set_quota, scope, name, quota,
                                          self.current_user["name"])
        except QuotaError as e:
            raise FieldError(400, e.field, e.message) from None
        self.settings["on_quota_change"](scope, name)
        if disks is not None:  # made, grown or shrunk now (mkfs, resize2fs: in a thread)
            await asyncio.to_thread(disks.apply, [u for u in users if scope != "user"
                                                  or u["name"] == name])
        self.send(row)

    async def delete(self, kind, name=None):
        scope, name = self._target(kind, name)
        if not await asyncio.to_thread(self.ledger.unset_quota, scope, name,
                                       self.current_user["name"]):
            raise web.HTTPError(404, f"No {scope} quota is set" + (f" for '{name}'." if name else "."))
        self.settings["on_quota_change"](scope, name)
        self.set_status(204)
        self.finish()


class AllocationsHandler(APIHandler):
    async def get(self):
        who = self.get_query_argument("user", None)
        if not self.is_gpulab_admin:
            if who not in (None, self.current_user["name"]):
                raise web.HTTPError(403, "You may only see your own allocations.")
            who = self.current_user["name"]
        offset, limit = self.page_args()
        allocs = await asyncio.to_thread(self.ledger.open_allocations, user=who)
        self.send_page("allocations", [a.as_dict() for a in allocs[offset:offset + limit]],
                       offset, limit, len(allocs))


class UsageHandler(APIHandler):
    async def get(self):
        days = self.int_arg("days", 7, 1, 366)
        offset, limit = self.page_args()
        now = time.time()
        if not self.is_gpulab_admin:
            name = self.current_user["name"]
            hours = (await asyncio.to_thread(self.ledger.usage, now - days * DAY, now,
                                             user=name)).get(name, 0.0)
            self.send({"days": days, "users": {name: round(hours, 3)}, "groups": {},
                       "_pagination": {"offset": offset, "limit": limit, "total": 1 - min(offset, 1),
                                       "next": None}})
            return
        users = await asyncio.to_thread(self.ledger.usage, now - days * DAY, now)
        groups: dict[str, float] = {}
        for u in await self.directory.users():
            for g in u["groups"]:
                groups[g] = groups.get(g, 0.0) + users.get(u["name"], 0.0)
        # a page of people and a page of groups (the same offset and limit), each sorted by name
        people, teams = sorted(users.items()), sorted(groups.items())
        total = max(len(people), len(teams))
        nxt = offset + limit
        self.send({"days": days,
                   "users": {k: round(v, 3) for k, v in people[offset:nxt]},
                   "groups": {k: round(v, 3) for k, v in teams[offset:nxt]},
                   "_pagination": {"offset": offset, "limit": limit, "total": total,
                                   "next": {"offset": nxt, "limit": limit} if nxt < total
                                   else None}})


class AuditHandler(APIHandler):
    async def get(self):
        self.require_admin()
        offset, limit = self.page_args(default=100)
        rows, total = await asyncio.to_thread(audit_page, self.ledger, offset, limit)
        self.send_page("audit", rows, offset, limit, total)
