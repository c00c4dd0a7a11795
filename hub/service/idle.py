"""GPU-idle culling in the gpulab service: warn, then stop, servers and jobs whose GPUs sit idle.

`IdleCuller` runs once per usage sampling round (``c.GPUInventory.usage_interval``): it reads
the open allocations (in a worker thread), the latest figures of their GPUs (the sampler's
snapshot: no wait) and the owners' groups (the hub directory's cached list), asks the policy
(`gpulab.hub.quota.idle.IdleTracker`, rules from ``c.GPUIdle``) and acts:

- ``warn``: a notice the owner sees on My GPUs (and the API ``GET /api/v1/idle``), a row in
  the audit trail, a line in the log;
- ``stop``: a server is stopped through the hub's API (the service's role has
  ``delete:servers``), a job through its backend; its allocation is closed with the reason,
  which the audit trail and My GPUs ("Stopped for idle GPUs") show.

"Keep for N hours" (``POST /api/v1/servers/<name>/keep``, ``{"hours": 2}``) holds off the
culler for one of the person's servers, at most ``c.GPUIdle.keep_max_hours``; longer is a 400.
The culler's clocks live in this process: a service restart starts them again (so a holding is
never stopped sooner than the settings say), and keeps are re-asked after a restart.
"""

from __future__ import annotations

import asyncio
import time

from tornado.ioloop import PeriodicCallback

from gpulab.hub.quota.idle import IdleSettings, IdleTracker
from gpulab.hub.service.base import APIHandler, FieldError, log

ACTOR = "gpulab (idle GPUs)"
SCOPE = "idle"


def _minutes(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def event_name(user: str, kind: str, holder: str) -> str:
    return f"{user}/{kind}/{holder}"


class IdleCuller:
    def __init__(self, ledger, usage, directory, settings: IdleSettings, jobs=None):
        self.ledger, self.usage, self.directory = ledger, usage, directory
        self.settings, self.jobs = settings, jobs
        self.tracker = IdleTracker()
        #: alloc id -> the notice its owner sees
        self.notices: dict[str, dict] = {}
        #: alloc id -> (user, server) of the keeps asked
        self._kept: dict[str, tuple[str, str]] = {}
        self._busy = False
        self._pc: PeriodicCallback | None = None

    # -- the round

    async def _profiles(self) -> dict[tuple[str, str], str]:
        """``(user, server) -> profile slug`` of running servers (only when a rule needs it)."""
        if not any(r.profiles for r in self.settings.rules):
            return {}
        try:
            out = {}
            for u in await self.directory._all_users():
                for name, server in (u.get("servers") or {}).items():
                    opts = (server or {}).get("user_options") or {}
                    out[(u["name"], name or "default")] = str(opts.get("profile", ""))
            return out
        except Exception as e:
            log.warning("GPU-idle culling: the servers' profiles were not read (%s)", e)
            return {}

    async def tick(self, now: float | None = None) -> list[tuple[str, dict]]:
        """One round; returns what was done (``("warn" | "stop", holding)``)."""
        if self._busy:
            return []
        self._busy = True
        try:
            return await self._tick(now)
        finally:
            self._busy = False

    async def _tick(self, now: float | None) -> list[tuple[str, dict]]:
        allocs = [a for a in await asyncio.to_thread(self.ledger.open_allocations) if a.gpus]
        self.tracker.forget_except(a.id for a in allocs)
        for k in set(self.notices) - {a.id for a in allocs}:
            del self.notices[k]
        if not allocs:
            return []
        readings = self.usage.readings()
        groups = {u["name"]: u["groups"] for u in await self.directory.users()}
        profiles = await self._profiles()
        now = time.time() if now is None else now
        done = []
        by_alloc = self.usage.by_allocation(allocs, readings)
        for a in allocs:
            rule = self.settings.rule_for(a.kind, groups.get(a.user, ()),
                                          profiles.get((a.user, a.holder)))
            entries = by_alloc.get(a.id, [])
            measured = [e for e in entries if e.get("measured")]
            if not measured or len(measured) < len(entries):
                busy = None  # something not measured: never culled on a guess
            else:
                busy = any(e["gpu_percent"] >= rule.threshold_percent for e in measured)
            action = self.tracker.observe(a.id, busy, rule, now)
            if busy is not False:
                self.notices.pop(a.id, None)
            if action is None:
                continue
            holding = {"id": a.id, "user": a.user, "kind": a.kind, "name": a.holder,
                       "gpus": a.gpus, "idle_since": action.idle_since}
            try:
                if action.what == "warn":
                    await self._warn(a, action, holding, now)
                else:
                    await self._stop(a, action, holding, now)
            except Exception:
                log.exception("GPU-idle culling of %s %s/%s failed; retried next round",
                              a.kind, a.user, a.holder)
                continue
            done.append((action.what, holding))
        return done

    def _what(self, a) -> str:
        return f"server '{a.holder}'" if a.kind == "notebook" else f"job '{a.holder}'"

    async def _warn(self, a, action, holding, now) -> None:
        rule = action.rule
        idle = _minutes(max(now - action.idle_since, rule.idle_seconds - rule.warn_seconds))
        if action.stop_at is not None:
            text = (f"Your {self._what(a)} has held {a.gpus} GPU(s) below "
                    f"{rule.threshold_percent:g}% use for {idle}: it will be stopped and its "
                    f"GPUs given back in {_minutes(max(0.0, action.stop_at - now))} unless they "
                    "are used" + (" or you keep it." if a.kind == "notebook" else "."))
        else:
            text = (f"Your {self._what(a)} has held {a.gpus} GPU(s) below "
                    f"{rule.threshold_percent:g}% use for {idle}: please stop it if you do "
                    "not need them, so that others can use them.")
        notice = {**holding, "state": "warned", "stop_at": action.stop_at, "text": text,
                  "can_keep": a.kind == "notebook" and self.settings.keep_max_hours > 0}
        self.notices[a.id] = notice
        log.warning("GPU-idle: warned %s %s/%s (%d GPUs idle since %.0f)", a.kind, a.user,
                    a.holder, a.gpus, action.idle_since)
        await asyncio.to_thread(self.ledger.record, ACTOR, SCOPE,
                                event_name(a.user, a.kind, a.holder),
                                {"action": "warned", "kind": a.kind, "holder": a.holder,
                                 "text": f"warned: {text}"}, now)

    async def _stop(self, a, action, holding, now) -> None:
        rule = action.rule
        reason = (f"stopped: its GPUs stayed below {rule.threshold_percent:g}% use for "
                  f"{_minutes(now - action.idle_since)} (GPU-idle culling)")
        if a.kind == "notebook":
            await self.directory.stop_server(a.user, a.holder)
        elif self.jobs is not None:
            await self.jobs.stop(a.user, a.holder, reason=reason, actor=ACTOR)
        # the GPUs come back now, with the reason (the spawner's own release after its stop
        # finds the allocation closed)
        await asyncio.to_thread(self.ledger.release, a.id, reason)
        self.notices.pop(a.id, None)
        log.warning("GPU-idle: stopped %s %s/%s, %d GPU(s) given back: %s", a.kind, a.user,
                    a.holder, a.gpus, reason)
        await asyncio.to_thread(self.ledger.record, ACTOR, SCOPE,
                                event_name(a.user, a.kind, a.holder),
                                {"action": "stopped", "kind": a.kind, "holder": a.holder,
                                 "gpus": a.gpus, "text": f"{self._what(a)} {reason}"}, now)

    # -- keep

    async def keep(self, user: str, server: str, hours: float, actor: str) -> dict:
        limit = self.settings.keep_max_hours
        if not isinstance(hours, (int, float)) or isinstance(hours, bool) or hours <= 0:
            raise FieldError(400, "hours", "'hours' must be a number of hours above 0.")
        if hours > limit:
            raise FieldError(400, "hours", (f"A server may be kept for at most {limit:g} hours "
                                            f"(asked: {hours:g})." if limit else
                                            "Keeping servers is turned off on this hub."))
        server = server or "default"
        allocs = await asyncio.to_thread(self.ledger.open_allocations, user, "notebook")
        mine = [a for a in allocs if a.holder == server and a.gpus]
        if not mine:
            raise FieldError(404, "server", f"{user} has no server '{server}' holding GPUs.")
        until = time.time() + hours * 3600
        for a in mine:
            self.tracker.keep(a.id, until)
            self.notices.pop(a.id, None)
            self._kept[a.id] = (user, server)
        text = f"server '{server}' kept for {hours:g} h (GPU-idle culling holds off)"
        await asyncio.to_thread(self.ledger.record, actor, SCOPE,
                                event_name(user, "notebook", server),
                                {"action": "kept", "kind": "notebook", "holder": server,
                                 "until": until, "text": text})
        log.info("GPU-idle: %s keeps %s's server '%s' for %g h", actor, user, server, hours)
        return {"user": user, "server": server, "kept_until": until, "hours": hours,
                "max_hours": limit}

    # -- what people see

    def view(self, user: str) -> dict:
        """The notices and keeps of `user`'s holdings (the page and ``GET /idle``)."""
        notices = [n for n in self.notices.values() if n["user"] == user]
        kept = []
        for a_id, (owner, server) in list(self._kept.items()):
            st = self.tracker.state(a_id)
            if st is None or not st.keep_until or st.keep_until <= time.time():
                del self._kept[a_id]  # ended, or the holding is gone
            elif owner == user:
                kept.append({"id": a_id, "server": server, "kept_until": st.keep_until})
        return {"notices": notices, "kept": kept, "keep_max_hours": self.settings.keep_max_hours}

    def start(self, interval: float) -> None:
        self._pc = PeriodicCallback(self.tick, max(0.05, interval) * 1000)
        self._pc.start()


def recent_stops(ledger, user: str, limit: int = 5) -> list[dict]:
    """The newest GPU-idle stops of `user`'s servers and jobs (My GPUs; blocking: a thread)."""
    return [e for e in ledger.events(SCOPE, f"{user}/", limit * 3)
            if (e.get("new") or {}).get("action") == "stopped"
            and e["name"].split("/", 1)[0] == user][:limit]


class IdleHandler(APIHandler):
    """``GET /api/v1/idle``: my holdings' idle notices and keeps (an admin: ``?user=``)."""

    async def get(self):
        culler = self.settings.get("idle_culler")
        me = self.current_user["name"]
        user = self.get_query_argument("user", me)
        if user != me:
            self.require_admin()
        view = culler.view(user) if culler is not None else {"notices": [], "kept": [],
                                                             "keep_max_hours": 0}
        view["enabled"] = culler is not None
        view["stopped"] = await asyncio.to_thread(recent_stops, self.ledger, user)
        self.send(view)


class KeepHandler(APIHandler):
    """``POST /api/v1/servers/<name>/keep`` ``{"hours": 2}`` (``default``: the default
    server; an admin may add ``?user=``)."""

    async def post(self, server):
        culler = self.settings.get("idle_culler")
        if culler is None:
            raise FieldError(409, "server", "GPU-idle culling is off on this hub: there is "
                             "nothing to keep a server from.")
        me = self.current_user["name"]
        user = self.get_query_argument("user", me)
        if user != me:
            self.require_admin()
        body = self.json_body()
        if not isinstance(body, dict) or "hours" not in body:
            raise FieldError(400, "hours", 'Send {"hours": <number>}.')
        self.send(await culler.keep(user, server, body["hours"], me))

