"""Who knocks at the hub's door, and how often: the address a request came from, and counters
that slow down whoever keeps failing (wrong passwords) or keeps asking (sign-ups).

Used by `gpulab.hub.deploy.auth`. Nothing here does I/O; every method is quick and runs on
the hub's event loop.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable

#: IPv6 clients are counted by their /64: one host (one customer of a provider) holds a whole
#: /64, so counting single IPv6 addresses would give an attacker 2**64 fresh addresses
IPV6_PREFIX = 64


def _canonical(text: str) -> str | None:
    """``text`` as a canonical address (IPv4-mapped IPv6 as IPv4, IPv6 as its /64), or None
    when it is no address."""
    try:
        ip = ipaddress.ip_address(text.strip().strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/{IPV6_PREFIX}", strict=False))
    return str(ip)


def client_address(request) -> str:
    """The address a hub request came from, as the limits count it.

    Requests reach the hub through configurable-http-proxy, which appends the address it saw to
    ``X-Forwarded-For``; so the address is that header's right-most entry that is not one of
    ``c.JupyterHub.trusted_downstream_ips`` (an operator's reverse proxy in front), else the
    connection's own peer. Tornado's ``remote_ip`` is not used: it takes ``X-Real-Ip`` as is,
    a header any client may send through the proxy, which would make every request come from
    wherever the attacker says. Entries a client wrote itself sit left of the proxy's and are
    never reached unless the operator trusts the proxies that appended after them.
    """
    context = getattr(request, "connection", None)
    context = getattr(context, "context", None)
    trusted: Iterable[str] = getattr(context, "trusted_downstream", None) or ()
    trusted = {_canonical(t) or t for t in trusted}
    peer = getattr(context, "_orig_remote_ip", None) or request.remote_ip or ""
    hops = [h for h in request.headers.get("X-Forwarded-For", "").split(",") if h.strip()]
    for hop in reversed(hops):
        address = _canonical(hop)
        if address is None:  # garbage where the proxy should have written an address
            break
        if address not in trusted:
            return address
    return _canonical(peer) or peer or "unknown"


class Backoff:
    """Failures counted per key: the first `free` cost nothing; from the `free`-th on, the key
    must wait `start` seconds, doubling with every further failure up to `cap`.

    A key waiting is refused without being counted (waiting out the time is the only way
    forward); a success forgets the key; a key with no failure for `forget` seconds is
    forgotten. At most `max_keys` keys are kept (the oldest go first), so that a flood of
    made-up names cannot fill the hub's memory.
    """

    def __init__(self, free: int, start: float, cap: float, forget: float = 3600,
                 max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic):
        self.free, self.start, self.cap, self.forget = free, start, cap, max(forget, cap)
        self.max_keys, self.clock = max_keys, clock
        #: key -> [failures, time of the last failure, time until which it waits]
        self._keys: OrderedDict[Hashable, list[float]] = OrderedDict()

    def _entry(self, key: Hashable, now: float) -> list[float] | None:
        entry = self._keys.get(key)
        if entry is not None and now - entry[1] > self.forget:
            del self._keys[key]
            return None
        return entry

    def wait(self, key: Hashable) -> float:
        """Seconds `key` must still wait before its next try (0: it may try now)."""
        if self.free <= 0:
            return 0.0
        now = self.clock()
        entry = self._entry(key, now)
        return max(0.0, entry[2] - now) if entry else 0.0

    def failed(self, key: Hashable) -> None:
        if self.free <= 0:
            return
        now = self.clock()
        entry = self._entry(key, now) or [0, now, now]
        entry[0] += 1
        entry[1] = now
        if entry[0] >= self.free:
            entry[2] = now + min(self.cap, self.start * 2 ** (entry[0] - self.free))
        self._keys[key] = entry
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def succeeded(self, key: Hashable) -> None:
        self._keys.pop(key, None)


class Window:
    """At most `limit` events per key in any `seconds` (0: no limit); `max_keys` keys at most."""

    def __init__(self, limit: int, seconds: float = 3600, max_keys: int = 100_000,
                 clock: Callable[[], float] = time.monotonic):
        self.limit, self.seconds, self.max_keys, self.clock = limit, seconds, max_keys, clock
        self._events: OrderedDict[Hashable, deque[float]] = OrderedDict()

    def _recent(self, key: Hashable, now: float) -> deque[float]:
        events = self._events.get(key) or deque()
        while events and events[0] <= now - self.seconds:
            events.popleft()
        return events

    def full(self, key: Hashable) -> bool:
        return bool(self.limit) and len(self._recent(key, self.clock())) >= self.limit

    def add(self, key: Hashable) -> None:
        if not self.limit:
            return
        now = self.clock()
        events = self._recent(key, now)
        events.append(now)
        self._events[key] = events
        self._events.move_to_end(key)
        while len(self._events) > self.max_keys:
            self._events.popitem(last=False)
