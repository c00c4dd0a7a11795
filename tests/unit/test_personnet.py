"""hub/machine/personnet.py: a person's network namespace and the hub's relays, in real namespaces.

A "server" (a thread of this process that makes its sockets inside the namespace with
`sandbox.socket_in_netns`) listens in the person's namespace; the relay from the machine's
side reaches it, it reaches a "hub" on the machine's loopback through the relay inside, and
nothing else of the machine. Needs root (skipped without it; the security tier attacks the
same through a real hub, tests/security/test_person_network.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest

from gpulab.hub.machine import sandbox
from gpulab.hub.machine.personnet import NetworkUnusable, PersonNetworks, loopback_address

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root")


@pytest.mark.parametrize("url, want", [
    ("https://127.0.0.1:8081/hub/api", ("127.0.0.1", 8081)),
    ("http://localhost/services/gpulab/", ("127.0.0.1", 80)),
    ("https://127.0.0.1/hub/api", ("127.0.0.1", 443)),
    ("http://[::1]:9000/", ("::1", 9000)),
], ids=["hub", "localhost", "https-default", "ipv6"])
def test_loopback_addresses_are_relayed(url, want):
    assert loopback_address(url, "The hub's API") == want


@pytest.mark.parametrize("url", ["https://10.0.0.5:8081/hub/api", "http://hub.example/",
                                 "http://0.0.0.0:8081/"], ids=["lan", "name", "any"])
def test_other_addresses_are_refused_with_the_setting_named(url):
    with pytest.raises(NetworkUnusable, match="private_network"):
        loopback_address(url, "The hub's API")


def _listener(host: str = "127.0.0.1", netns=None) -> socket.socket:
    s = sandbox.socket_in_netns(netns) if netns else socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen(8)
    return s


def _serve(sock: socket.socket, answer) -> threading.Thread:
    """Accept one connection, read to EOF (a half-close must come through), answer."""
    def run():
        c, _ = sock.accept()
        with c:
            data = b""
            while chunk := c.recv(65536):
                data += chunk
            c.sendall(answer(data))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _ask(addr, data: bytes, netns=None) -> bytes:
    s = sandbox.socket_in_netns(netns) if netns else socket.socket()
    with s:
        s.settimeout(10)
        s.connect(addr)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


@root_only
async def test_the_server_is_reached_through_its_relay_and_reaches_only_the_hub(tmp_path):
    nets = PersonNetworks(tmp_path / "netns")
    hub = _listener()  # the machine's side
    other = _listener()  # another service of the machine, not relayed
    hub_addr, other_addr = hub.getsockname(), other.getsockname()
    path = await nets.join("person-x", "", [hub_addr])
    server = None
    try:
        port = await nets.open_server("person-x", "", "127.1.0.7", 0)
        server = sandbox.socket_in_netns(path)  # the server, inside, on the relay's port
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.1.0.7", port))
        server.listen(8)
        big = os.urandom(3 << 20)  # more than a pipe buffers: flow control both ways
        # the "hub" answers a call the server makes from inside, through the relay
        _serve(hub, lambda d: b"hub:" + d[-4:] + len(d).to_bytes(4, "big"))
        got = await asyncio.to_thread(_ask, hub_addr, big, path)
        assert got == b"hub:" + big[-4:] + len(big).to_bytes(4, "big")
        # the proxy's request reaches the server through its relay, a half-close too
        _serve(server, lambda d: d[::-1])
        got = await asyncio.to_thread(_ask, ("127.1.0.7", port), big)
        assert got == big[::-1]
        # nothing else of the machine is there inside
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(_ask, other_addr, b"x", path)
        # a second server of the person joins the same namespace
        assert await nets.join("person-x", "b", [hub_addr]) == path
        assert not await nets.leave("person-x", "")
        assert path.exists()
        assert await nets.leave("person-x", "b")
        assert not path.exists()
        # its relay is gone with it
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(_ask, ("127.1.0.7", port), b"x")
    finally:
        for s in (hub, other, server):
            if s is not None:
                s.close()
        await nets.leave("person-x", "")


@root_only
async def test_concurrent_starts_make_one_namespace(tmp_path):
    nets = PersonNetworks(tmp_path / "netns")
    hub = _listener()
    try:
        paths = await asyncio.gather(*(nets.join("person-y", n, [hub.getsockname()])
                                       for n in ("a", "b", "c")))
        assert len(set(paths)) == 1
        assert sandbox.netns_names(tmp_path / "netns") == ["person-y"]
        for n in ("a", "b"):
            assert not await nets.leave("person-y", n)
        assert await nets.leave("person-y", "c")
        assert sandbox.netns_names(tmp_path / "netns") == []
    finally:
        hub.close()


@root_only
async def test_a_namespace_left_by_a_dead_hub_is_made_anew_or_adopted(tmp_path):
    base = tmp_path / "netns"
    old = sandbox.make_netns("person-z", base)
    ino = os.stat(old).st_ino
    # a server found running keeps the namespace it runs in
    adopter = PersonNetworks(base)
    assert await adopter.join("person-z", "", [], adopt=True) == old
    assert os.stat(old).st_ino == ino
    assert await adopter.leave("person-z", "")
    # a fresh start does not join a namespace nobody holds: a new one
    sandbox.make_netns("person-z", base)
    fd = os.open(base / "person-z", os.O_RDONLY)
    try:
        before = os.fstat(fd)
        nets = PersonNetworks(base)
        await nets.join("person-z", "", [])
        after = os.stat(base / "person-z")
        assert (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino)
        assert await nets.leave("person-z", "")
    finally:
        os.close(fd)
    # a stop after a hub restart (nobody registered) removes what is left
    sandbox.make_netns("person-z", base)
    assert await PersonNetworks(base).leave("person-z", "")
    assert sandbox.netns_names(base) == []


@root_only
async def test_a_namespace_a_server_still_runs_in_is_kept_and_joined(tmp_path):
    """After a hub restart, before every server is polled: a stop (or a new start) of one
    server of the person neither removes nor replaces the namespace another one runs in."""
    import subprocess
    base = tmp_path / "netns"
    path = sandbox.make_netns("person-w", base)
    fd = sandbox.open_netns("person-w", base)
    sleeper = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: sandbox.join_netns(fd))
    os.close(fd)
    try:
        ino = os.stat(path).st_ino
        assert not await PersonNetworks(base).leave("person-w", "gone")
        assert os.stat(path).st_ino == ino
        nets = PersonNetworks(base)
        assert await nets.join("person-w", "new", []) == path
        assert os.stat(path).st_ino == ino  # the running server's, not a new one
    finally:
        sleeper.kill()
        sleeper.wait()
    assert await nets.leave("person-w", "new")
    assert sandbox.netns_names(base) == []
