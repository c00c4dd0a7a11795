"""hub/machine/egress.py: the egress proxy inside a person's namespace, in real namespaces.

The destination check is a table of addresses. The proxy runs as the hub runs it (a
`PersonNetworks` namespace with ``egress``); the "internet" is a second network namespace
joined to the machine by a veth pair (198.18.0.1 the machine's end, 198.18.0.2 the other,
both on a network of the machine's interfaces, so refused) serving HTTP at 198.18.1.2 (a
benchmarking address, routed through 198.18.0.2: beyond the machine). Namespaces and links
are removed after each test. Needs root for the namespaces (skipped without it).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import subprocess
import threading
import uuid

import pytest

from gpulab.hub.machine import egress, sandbox
from gpulab.hub.machine.egress import parse_networks, proxy_env, refusal
from gpulab.hub.machine.personnet import PersonNetworks

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root")

#: the machine's interfaces' networks, as `egress.machine_networks` gives them
LOCAL = [ipaddress.ip_network(a, strict=False) for a in (
    "127.0.0.0/8", "::1", "10.1.2.3/24", "2001:db8::7", "172.17.0.1/16")]


@pytest.mark.parametrize("ip", [
    "93.184.216.34", "2606:2800::1", "8.8.8.8", "198.18.0.2", "10.9.9.9",
    "::ffff:93.184.216.34", "64:ff9b::5db8:d822", "2002:5db8:d822::1",
])
def test_public_addresses_are_allowed(ip):
    assert refusal(ip, [], LOCAL) is None


@pytest.mark.parametrize("ip, why", [
    ("127.0.0.1", "loopback"), ("127.1.0.7", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "this machine"), ("2001:db8::7", "this machine"),
    ("10.1.2.77", "network of this machine's interfaces"),
    ("172.17.0.2", "network of this machine's interfaces"),  # (a container on a bridge)
    ("169.254.169.254", "link-local"), ("169.254.170.2", "link-local"),
    ("fe80::1", "link-local"), ("fd00:ec2::254", "AWS"),
    ("100.64.0.1", "shared address"), ("100.127.255.254", "shared address"),
    ("168.63.129.16", "Azure"), ("100.100.100.200", "shared address"),
    ("0.0.0.0", "unspecified"), ("0.1.2.3", "unspecified"), ("::", "unspecified"),
    ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"), ("ff02::1", "multicast"),
    ("255.255.255.255", "reserved"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "link-local"),
    ("::ffff:10.1.2.3", "this machine"), ("::127.0.0.1", "loopback"),
    ("64:ff9b::a9fe:a9fe", "link-local"), ("2002:7f00:1::", "loopback"),
    ("64:ff9b:1::1", "NAT64"),
])
def test_local_and_metadata_addresses_are_refused(ip, why):
    assert why in (refusal(ip, [], LOCAL) or ""), ip


def test_the_operators_networks_are_refused():
    refused = parse_networks(["10.0.0.0/8", "2001:db8:1::/48"])
    assert "10.0.0.0/8" in refusal("10.9.9.9", refused, LOCAL)
    assert refusal("::ffff:10.9.9.9", refused, LOCAL)
    assert refusal("2001:db8:1::5", refused, LOCAL)
    assert refusal("11.0.0.1", refused, LOCAL) is None
    with pytest.raises(ValueError, match="not a network"):
        parse_networks(["10.0.0.0/33"])


def test_the_machines_own_addresses_are_found():
    mine = egress.machine_addresses()
    assert ipaddress.ip_address("127.0.0.1") in mine
    assert ipaddress.ip_network("127.0.0.0/8") in egress.machine_networks()
    for a in mine:  # (every one refused, whatever else it is)
        assert refusal(a, []), a
    for net in egress.machine_networks():
        assert refusal(net[-2] if net.num_addresses > 2 else net[0], []), net


def test_the_environment_names_the_proxy_and_keeps_the_hub_direct():
    env = proxy_env(("127.0.0.1", 3128), ["127.0.0.1", "127.0.0.2"])
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert env[k] == "http://127.0.0.1:3128"
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,127.0.0.1,::1,127.0.0.2"


# -- the proxy, in real namespaces ---------------------------------------------------------

def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def internet(tmp_path):
    """A namespace serving HTTP on 198.18.1.2:8080 (each request's head echoed back), routed
    through 198.18.0.2 at the end of a veth pair from the machine (198.18.0.1)."""
    tag = uuid.uuid4().hex[:6]
    outside, inside = f"gteA{tag}", f"gteB{tag}"
    path = sandbox.make_netns(f"inet-{tag}", tmp_path / "inet")
    _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
    server = None
    try:
        _sh("ip", "link", "set", inside, "netns", str(path))
        _sh("ip", "addr", "add", "198.18.0.1/30", "dev", outside)
        _sh("ip", "link", "set", outside, "up")
        for cmd in (["ip", "addr", "add", "198.18.0.2/30", "dev", inside],
                    ["ip", "link", "set", inside, "up"], ["ip", "link", "set", "lo", "up"],
                    ["ip", "addr", "add", "198.18.1.2/32", "dev", "lo"]):
            _sh("nsenter", f"--net={path}", *cmd)
        _sh("ip", "route", "add", "198.18.1.2/32", "via", "198.18.0.2", "dev", outside)
        server = sandbox.socket_in_netns(path)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", 8080))
        server.listen(16)

        def serve():
            while True:
                try:
                    c, _ = server.accept()
                except OSError:
                    return
                threading.Thread(target=answer, args=(c,), daemon=True).start()

        def answer(c):
            with c:
                data = b""
                while b"\r\n\r\n" not in data and (chunk := c.recv(65536)):
                    data += chunk
                body = b"ECHO " + data
                try:
                    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close"
                              b"\r\n\r\n" % len(body) + body)
                except OSError:
                    pass

        threading.Thread(target=serve, daemon=True).start()
        yield ("198.18.1.2", 8080)
    finally:
        if server is not None:
            server.shutdown(socket.SHUT_RDWR)
            server.close()
        subprocess.run(["ip", "link", "del", outside], capture_output=True)
        sandbox.remove_netns(path.name, path.parent)
    gone = subprocess.run(["ip", "link", "show", outside], capture_output=True)
    assert gone.returncode != 0, "the veth pair outlived the test"


def _ask(netns, data: bytes, proxy=("127.0.0.1", egress.PROXY_PORT), then: bytes = b"") -> bytes:
    """Send ``data`` to the proxy from inside ``netns``; after its first answer, ``then``
    (through a tunnel); everything read until the end."""
    s = sandbox.socket_in_netns(netns)
    with s:
        s.settimeout(10)
        s.connect(proxy)
        s.sendall(data)
        out = b""
        if then:
            while b"\r\n\r\n" not in out:
                chunk = s.recv(65536)
                if not chunk:
                    return out
                out += chunk
            s.sendall(then)
        while chunk := s.recv(65536):
            out += chunk
        return out


@root_only
async def test_the_proxy_reaches_the_network_and_refuses_the_machine(tmp_path, internet):
    nets = PersonNetworks(tmp_path / "netns")
    hub = socket.socket()
    hub.bind(("127.0.0.1", 0))
    hub.listen(4)
    hub_port = hub.getsockname()[1]
    path = await nets.join("person-e", "", [hub.getsockname()], egress=[])
    try:
        assert nets.proxy_address("person-e") == ("127.0.0.1", egress.PROXY_PORT)
        host, port = internet
        # HTTPS and the like: a tunnel
        got = await asyncio.to_thread(
            _ask, path, f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode(),
            then=b"GET /tunnelled HTTP/1.1\r\nHost: x\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.1 200 OK"), got
        assert b"ECHO GET /tunnelled HTTP/1.1" in got
        # plain http://: forwarded in origin form, with Connection: close, no Proxy- headers
        got = await asyncio.to_thread(
            _ask, path, f"GET http://{host}:{port}/simple/pip/?q=1 HTTP/1.1\r\nHost: {host}:"
                        f"{port}\r\nProxy-Authorization: x\r\nConnection: keep-alive\r\n\r\n"
                        .encode())
        assert got.startswith(b"HTTP/1.1 200 OK"), got
        head = got.split(b"ECHO ", 1)[1]
        assert head.startswith(b"GET /simple/pip/?q=1 HTTP/1.1\r\n"), head
        assert b"Connection: close" in head and b"Proxy-" not in head and b"keep-alive" not in head

        # the machine: by loopback (the hub's port, by name and by address), its own
        # addresses, mapped IPv6, the metadata service
        for target in (f"127.0.0.1:{hub_port}", f"localhost:{hub_port}", "198.18.0.1:22",
                       "198.18.0.2:8080",  # (on the network of an interface of the machine)
                       f"[::ffff:127.0.0.1]:{hub_port}", f"[::1]:{hub_port}",
                       "169.254.169.254:80", "100.100.100.200:80", "0.0.0.0:22"):
            got = await asyncio.to_thread(
                _ask, path, f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
            assert got.startswith(b"HTTP/1.1 403 Forbidden"), (target, got)
            assert b"refused" in got, got
        got = await asyncio.to_thread(
            _ask, path, f"GET http://127.0.0.1:{hub_port}/ HTTP/1.1\r\n\r\n".encode())
        assert got.startswith(b"HTTP/1.1 403 "), got
        for bad in (b"GET https://example.org/ HTTP/1.1\r\n\r\n", b"HELLO\r\n\r\n",
                    b"CONNECT nowhere HTTP/1.1\r\n\r\n"):
            got = await asyncio.to_thread(_ask, path, bad)
            assert got.startswith(b"HTTP/1.1 400 "), (bad, got)
        # an open tunnel ends with the person's namespace
        s = await asyncio.to_thread(sandbox.socket_in_netns, path)
        s.settimeout(10)
        await asyncio.to_thread(s.connect, ("127.0.0.1", egress.PROXY_PORT))
        await asyncio.to_thread(s.sendall, f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n".encode())
        assert (await asyncio.to_thread(s.recv, 100)).startswith(b"HTTP/1.1 200")
        assert await nets.leave("person-e", "")
        assert await asyncio.to_thread(s.recv, 100) == b""
        s.close()
    finally:
        hub.close()
        await nets.leave("person-e", "")


@root_only
async def test_the_operators_networks_limits_and_no_proxy(tmp_path, internet, monkeypatch):
    host, port = internet
    monkeypatch.setattr(egress, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(egress, "IDLE_TIMEOUT", 1.0)
    nets = PersonNetworks(tmp_path / "netns")
    path = await nets.join("person-f", "", [], egress=parse_networks(["198.18.1.0/24"]))
    plain = await nets.join("person-g", "", [])  # notebook_egress off: nothing listens
    try:
        got = await asyncio.to_thread(_ask, path, f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n"
                                      .encode())
        assert got.startswith(b"HTTP/1.1 403 ") and b"198.18.1.0/24" in got, got
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(_ask, plain, b"CONNECT 8.8.8.8:443 HTTP/1.1\r\n\r\n")
        assert nets.proxy_address("person-g") is None

        # at most MAX_CONNECTIONS at once; an idle one is closed
        held = []
        for _ in range(2):
            s = await asyncio.to_thread(sandbox.socket_in_netns, path)
            s.settimeout(10)
            await asyncio.to_thread(s.connect, ("127.0.0.1", egress.PROXY_PORT))
            held.append(s)
        await asyncio.sleep(0.2)
        got = await asyncio.to_thread(_ask, path, b"CONNECT 8.8.8.8:443 HTTP/1.1\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 503 "), got
        for s in held:
            s.close()

        # a tunnel with nothing moving either way for IDLE_TIMEOUT seconds is closed
        idle = await nets.join("person-h", "", [], egress=[])
        s = await asyncio.to_thread(sandbox.socket_in_netns, idle)
        with s:
            s.settimeout(10)
            await asyncio.to_thread(s.connect, ("127.0.0.1", egress.PROXY_PORT))
            await asyncio.to_thread(s.sendall, f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n"
                                    .encode())
            assert (await asyncio.to_thread(s.recv, 100)).startswith(b"HTTP/1.1 200")
            t0 = asyncio.get_running_loop().time()
            assert await asyncio.to_thread(s.recv, 100) == b""
            assert 0.9 <= asyncio.get_running_loop().time() - t0 < 5
    finally:
        for n in ("person-f", "person-g", "person-h"):
            await nets.leave(n, "")
    assert sandbox.netns_names(tmp_path / "netns") == []
