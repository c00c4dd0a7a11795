"""The hub's door counters (`gpulab.hub.deploy.throttle`): which address a request came from,
and how long a failing or flooding client waits. The hub-level attacks are in
tests/security/test_hub_doors.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tornado.httputil import HTTPHeaders

from gpulab.hub.deploy.throttle import Backoff, Window, client_address


def request(peer: str, trusted=(), **headers):
    context = SimpleNamespace(trusted_downstream=set(trusted), _orig_remote_ip=peer)
    return SimpleNamespace(headers=HTTPHeaders({k.replace("_", "-"): v for k, v in headers.items()}),
                           remote_ip=headers.get("X_Real_Ip", peer),
                           connection=SimpleNamespace(context=context))


@pytest.mark.parametrize("req, address", [
    (request("127.0.0.1", X_Forwarded_For="203.0.113.5"), "203.0.113.5"),
    # what a client writes itself sits left of what the proxy appended
    (request("127.0.0.1", X_Forwarded_For="10.0.0.1, 203.0.113.5"), "203.0.113.5"),
    (request("127.0.0.1", X_Forwarded_For="203.0.113.5", X_Real_Ip="10.9.8.7"), "203.0.113.5"),
    # an operator's reverse proxy, trusted, is skipped
    (request("127.0.0.1", trusted={"192.0.2.10"}, X_Forwarded_For="198.51.100.7, 192.0.2.10"),
     "198.51.100.7"),
    # node's IPv4-mapped form, and an IPv6 client counted by its /64
    (request("127.0.0.1", X_Forwarded_For="::ffff:127.0.0.66"), "127.0.0.66"),
    (request("127.0.0.1", X_Forwarded_For="2001:db8:1:2:aaaa::1"), "2001:db8:1:2::/64"),
    # no proxy header: the connection's peer; garbage in it: the peer too
    (request("198.51.100.9"), "198.51.100.9"),
    (request("198.51.100.9", X_Forwarded_For="not-an-address"), "198.51.100.9"),
], ids=["proxy", "client-written-left", "x-real-ip-ignored", "trusted-skipped", "mapped-v4",
        "v6-prefix", "no-header", "garbage"])
def test_the_address_is_the_one_the_proxy_saw(req, address):
    assert client_address(req) == address


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_backoff_forgives_some_failures_then_doubles_the_wait_up_to_the_cap():
    clock = Clock()
    b = Backoff(free=3, start=10, cap=35, clock=clock)
    for _ in range(2):
        b.failed("k")
        assert b.wait("k") == 0
    b.failed("k")
    assert b.wait("k") == 10
    clock.now += 10
    assert b.wait("k") == 0
    b.failed("k")
    assert b.wait("k") == 20
    clock.now += 20
    b.failed("k")
    assert b.wait("k") == 35  # 40, capped
    assert b.wait("other") == 0  # keys are apart
    b.succeeded("k")
    assert b.wait("k") == 0


def test_backoff_forgets_quiet_keys_and_keeps_few():
    clock = Clock()
    b = Backoff(free=1, start=5, cap=5, forget=60, max_keys=2, clock=clock)
    b.failed("a")
    clock.now += 61
    b.failed("a")
    assert b.wait("a") == 5  # the first failure was forgotten; one is enough here anyway
    b.failed("b")
    b.failed("c")  # "a", the oldest, goes
    assert b.wait("a") == 0 and b.wait("b") == 5 and b.wait("c") == 5
    assert Backoff(free=0, start=5, cap=5).wait("x") == 0  # 0: off


def test_window_counts_events_per_key_in_the_last_seconds():
    clock = Clock()
    w = Window(2, seconds=3600, clock=clock)
    w.add("a")
    w.add("a")
    assert w.full("a") and not w.full("b")
    clock.now += 3600
    assert not w.full("a")
    assert not Window(0).full("a")  # 0: no limit
