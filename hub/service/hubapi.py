"""The hub API client of the gpulab service: `HubDirectory` reads the hub's users, groups
and running servers with the service's own token, and caches them for a few seconds."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest


def hub_server_path(user: str, server: str) -> str:
    """The hub API path that stops `user`'s `server` (``default``: the default one)."""
    u = quote(user, safe="")
    if server in ("", "default"):
        return f"/users/{u}/server"
    return f"/users/{u}/servers/{quote(server, safe='')}"


log = logging.getLogger("gpulab.service")


def _log_failure(f: asyncio.Future) -> None:
    if not f.cancelled() and f.exception() is not None:
        log.warning("Reading the hub's users failed: %s", f.exception())


#: seconds a full read of the hub's users may take for the admin page to wait for a fresh
#: one (`HubDirectory.users_recent`); past it the page shows the list as last read and says
#: how old it is (10,000 people: ~1.8 s, 50 pages of 200 on a 2-core machine)
SLOW_READ = 0.25
#: and the people it must list (more than 5 of the hub's pages): a hub of a few hundred people
#: is always read fresh for the page, however loaded the machine (a slow read there is load,
#: not size)
MANY_PEOPLE = 1000


class HubDirectory:
    """Users and groups as the hub knows them, read with the service's own token.

    ``ttl``: seconds a full read of the users is reused; ``slow``: `SLOW_READ`; ``many``:
    `MANY_PEOPLE`; ``clock``: the monotonic clock (the tests' own)."""

    def __init__(self, api_url: str, token: str, ttl: float = 5.0, page: int = 200,
                 slow: float = SLOW_READ, many: int = MANY_PEOPLE, clock=time.monotonic):
        self.api_url, self.token, self.ttl = api_url.rstrip("/"), token, ttl
        self.page = page  # users a request (the hub's most, `api_page_max_limit`, is 200)
        self.slow, self.many, self.clock = slow, many, clock
        #: (when the read ended, the users); `forget` makes it stale, never drops it
        self._cache: tuple[float, list[dict]] | None = None
        self._read_at: float | None = None  # when the last full read began
        self._read_took: float | None = None  # and how long it took (seconds)
        #: full reads of the users (every page), for the tests
        self.full_reads = 0
        self._reads_all: bool | None = None
        self._one: dict[str, tuple[float, list[str]]] = {}  # groups_of, per person
        self._lock = asyncio.Lock()
        self._refresh: asyncio.Future | None = None

    async def _get(self, path: str):
        # the pagination form of lists (`_pagination`): without it the hub answers a bare
        # list cut at `limit`, and everyone past the first page would be missed
        req = HTTPRequest(self.api_url + path, headers={
            "Authorization": f"token {self.token}",
            "Accept": "application/jupyterhub-pagination+json"}, request_timeout=20)
        resp = await AsyncHTTPClient().fetch(req)
        return json.loads(resp.body)

    async def _all_users(self, state: str = "") -> list[dict]:
        """Every user model the hub lists, page by page (active servers only); with
        ``state="active"`` only the users who have a server running, starting or stopping
        (the hub filters: at 10,000 people and 1,000 servers, 5 pages, not 50)."""
        models, offset = [], 0
        state = f"&state={state}" if state else ""
        while True:
            page = await self._get(f"/users?offset={offset}&limit={self.page}"
                                   "&include_stopped_servers=0" + state)
            items = page["items"] if isinstance(page, dict) else page
            models.extend(items)
            if not isinstance(page, dict) or not page.get("_pagination", {}).get("next"):
                return models
            offset = page["_pagination"]["next"]["offset"]

    async def users(self, since: float | None = None) -> list[dict]:
        """Every user (name, sorted groups, admin), read in full when the last read is older
        than the ttl (callers meanwhile wait for that one read); with `since` (this
        directory's clock), unless the last read began at or after it (a read another caller
        began meanwhile counts)."""
        async with self._lock:
            if self._cache and (self._read_at >= since if since is not None
                                else self.clock() - self._cache[0] < self.ttl):
                return self._cache[1]
            began = self.clock()
            users = [{"name": u["name"], "groups": sorted(u.get("groups", [])),
                      "admin": bool(u.get("admin"))} for u in await self._all_users()]
            self.full_reads += 1
            end = self.clock()
            self._cache, self._read_at, self._read_took = (end, users), began, end - began
            return users

    async def users_recent(self) -> tuple[list[dict], float | None]:
        """The users for the admin page, and None, or how many seconds ago they were read.

        Where the last full read took under ``slow`` seconds, or listed at most ``many``
        people (a hub of a few hundred), this is a fresh list, read now and waited for
        (None).
        Where it took longer and listed more (10,000 people: ~1.8 s of the hub's and this
        service's time), the list as last read, with a
        fresh read started in the background once it is older than the ttl (`users_now`),
        and its age, which the page shows. The first read is always waited for."""
        if (self._cache is None or self._read_took is None or self._read_took < self.slow
                or len(self._cache[1]) <= self.many):
            # read now (one page of the hub's at a few hundred people): a person the hub has
            # just made shows at once, whatever the ttl
            return await self.users(since=self.clock()), None
        users = await self.users_now()
        return users, max(0.0, self.clock() - self._read_at)

    async def users_now(self) -> list[dict]:
        """The users as last read, however old (the metrics endpoint: a scrape never waits
        for the hub once they were read), with a fresh read started in the background when
        they are older than the ttl; the first call waits for the first read. A failed
        background read keeps the old list (and is logged)."""
        if self._cache is None:
            return await self.users()
        if self.clock() - self._cache[0] >= self.ttl and (
                self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.ensure_future(self.users())
            self._refresh.add_done_callback(_log_failure)
        return self._cache[1]

    async def active_servers(self) -> set[tuple[str, str]] | None:
        """``(user, server)`` of every server the hub has running or starting or stopping
        (``"default"`` for a user's default server, as the ledger names it), or None when the
        hub does not show servers to this service's token (no ``read:servers``)."""
        active = set()
        for u in await self._all_users("active"):
            if "servers" not in u:
                return None
            active.update((u["name"], name or "default") for name in u["servers"])
        return active

    async def groups_of(self, name: str) -> list[str]:
        """`name`'s groups: from the cached list of everyone when it is fresh, else from the
        hub's model of that one person (cached as long), never by listing every user: a
        person's page at 10,000 users reads 1 model, not 50 pages of them."""
        now = self.clock()
        if self._cache and now - self._cache[0] < self.ttl:
            for u in self._cache[1]:
                if u["name"] == name:
                    return u["groups"]
        hit = self._one.get(name)
        if hit and now - hit[0] < self.ttl:
            return hit[1]
        try:
            model = await self._get(f"/users/{quote(name, safe='')}")
        except Exception:
            return []
        groups = sorted(model.get("groups", []))
        if len(self._one) >= 4096:  # a bound: the oldest half goes
            for k in sorted(self._one, key=lambda k: self._one[k][0])[:2048]:
                del self._one[k]
        self._one[name] = (now, groups)
        return groups

    async def reads_every_user(self) -> bool:
        """Whether this service's token reads every user of the hub (``read:users`` without a
        filter), so that a 404 for a name means the hub has no such user: the hub answers 404
        for a user a token may not see too. Asked once."""
        if self._reads_all is None:
            scopes = (await self._get("/user")).get("scopes", [])
            self._reads_all = "read:users" in scopes or "admin:users" in scopes
        return self._reads_all

    async def gone(self, name: str) -> bool:
        """Whether the hub has no user `name` (its API answers 404); any other failure is
        raised, never taken for an answer."""
        try:
            await self._get(f"/users/{quote(name, safe='')}")
        except HTTPClientError as e:
            if e.code == 404:
                return True
            raise
        return False

    async def stop_server(self, user: str, server: str) -> int:
        """Ask the hub to stop `user`'s `server` (``default``: the default one), as an admin
        would (the service's role has ``delete:servers``): 204 stopped, 202 stopping; a
        server already gone (404, 400 "not running") is fine."""
        req = HTTPRequest(self.api_url + hub_server_path(user, server), method="DELETE",
                          headers={"Authorization": f"token {self.token}"},
                          request_timeout=60)
        try:
            resp = await AsyncHTTPClient().fetch(req)
        except HTTPClientError as e:
            if e.code in (400, 404):
                return e.code
            raise
        return resp.code

    def forget(self) -> None:
        """The next `users` reads the hub again; the list read so far stays what
        `users_now` and a slow hub's `users_recent` show meanwhile."""
        if self._cache is not None:
            self._cache = (-math.inf, self._cache[1])
        self._one.clear()
