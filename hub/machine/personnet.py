"""One network namespace per person for their notebook servers (issue 33 item 2).

A server that shares the machine's network shares it with everybody: a TensorFlow server a
notebook starts (``tf.distribute.Server``, which TensorFlow's parameter-server tutorial starts
in the notebook) listens on every address of the machine and runs any graph anyone sends it
(gRPC, no authentication), as the server's person. So every server of one person runs in that
person's own network namespace (`sandbox.make_netns`, `sandbox.join_netns`: the mechanism of
training jobs, one namespace per job), named as the person's control group
(``person-<hub>-<name>``), under ``/run/gpulab/netns/``:

- it holds only loopback (up). All servers of the person (named servers too) join it, so
  what one of their kernels serves on any port the person's other kernels and servers reach
  on ``127.0.0.1``; nobody else's process is in it, so nobody else reaches it.
- the proxy and the hub reach each server through a relay (`Bridge`, in the hub): a port on
  the machine's side, on the server's own address and port (``ip_per_server``), whose every
  connection is piped to a socket made inside the namespace (`sandbox.socket_in_netns`) and
  connected to the server there (same address, same port: its certificate names it). Only
  that port of that server: nothing else in the namespace is reachable from the machine.
- the server reaches the hub's API and the gpulab service the same way the other round: a
  socket inside the namespace listens on each of their loopback addresses and ports (the
  URLs the server is given stay as they are), and every connection to it is piped to the
  real one on the machine's side. TLS (``internal_ssl``) runs end to end through the pipes.
  Nothing else leaves the namespace: no other machine port; the network only through the
  egress proxy the relays' loop runs inside it (`gpulab.hub.machine.egress`, ``egress``).
- it is made by the person's first server start and removed when their last server stops
  (or is found dead); starts and stops of one person take one lock (`PersonNetworks`), so
  concurrent starts of named servers make one namespace, and a stop never removes one a
  start is about to join.

The relays run on an event loop of their own in one thread of the hub (`Bridge`), so their
traffic never holds up the hub's own loop. They end with the hub: with
``c.JupyterHub.cleanup_servers`` (gpulab up's default) servers stop with it anyway; a server
found running by a new hub (`LocalGPUSpawner.poll`) gets its relays again.

Why not systemd or bubblewrap: ``PrivateNetwork=`` gives each unit a namespace of its own
(``JoinsNamespaceOf=`` shares one between units of one manager) holding loopback alone, with
no way for the proxy to reach the server in it; systemd is not PID 1 on every machine gpulab
runs on (not here). bubblewrap's ``--unshare-net`` likewise makes a fresh loopback-only
namespace per process and cannot join an existing one, so a person's servers could not share
one. Both would still need what this module adds (a way in for the proxy, a way out to the
hub), and gpulab already makes and joins namespaces for jobs (a few ``setns``/``unshare``
calls through ctypes, `gpulab.spawner.sandbox`), which this reuses as it is.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from . import sandbox

log = logging.getLogger(__name__)

#: bytes a pipe buffers towards a slow side before it stops reading from the other
HIGH_WATER = 1 << 20

Address = tuple[str, int]


class NetworkUnusable(ValueError):
    """An address the server must reach cannot be relayed into its namespace (the message says
    which and what to do)."""


def loopback_address(url: str, what: str) -> Address:
    """``(host, port)`` of ``url`` for a relay inside a person's namespace: its host must be a
    loopback address (only those exist inside it); ``localhost`` is ``127.0.0.1``."""
    u = urlparse(url)
    host = u.hostname or ""
    port = u.port or (443 if u.scheme == "https" else 80)
    if host == "localhost":
        host = "127.0.0.1"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise NetworkUnusable(
            f"{what} ({url}) is not on a loopback address, which is all a server in its "
            "person's own network namespace can reach (c.LocalGPUSpawner.private_network)")
    return host, port


# -- pipes ---------------------------------------------------------------------------------

class _Pipe(asyncio.Protocol):
    """One side of a relayed connection: what it reads is written to its peer, with flow
    control both ways, and a half-close passed on; the pair closes once both sides ended."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.ended = False  # this side sent EOF
        self.pending: list[bytes] = []  # read before the peer was there

    def connection_made(self, transport):
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)

    def data_received(self, data):
        if self.peer is None:  # (asyncio may start reading before a pause takes hold)
            self.pending.append(data)
            self.transport.pause_reading()
            return
        self.peer.transport.write(data)

    def link(self, peer: _Pipe) -> None:
        """From now on what this side reads goes to ``peer`` (what it read so far first)."""
        self.peer = peer
        if self.pending:
            peer.transport.write(b"".join(self.pending))
            self.pending.clear()
        if self.ended and peer.transport.can_write_eof():
            peer.transport.write_eof()
        self.transport.resume_reading()

    def eof_received(self):
        self.ended = True
        peer = self.peer
        if peer is None:
            return True  # passed on by link
        if peer.transport is None or peer.transport.is_closing():
            return False
        if peer.ended:
            peer.transport.close()
            return False
        if peer.transport.can_write_eof():
            peer.transport.write_eof()
            return True
        peer.transport.close()
        return False

    def connection_lost(self, exc):
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.transport.is_closing():
            peer.transport.close()

    def pause_writing(self):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _Accepted(_Pipe):
    """The accepted side: reads nothing until its peer is connected (by ``connect``)."""

    def __init__(self, connect: Callable[[], Any], what: str):
        super().__init__()
        self.connect, self.what = connect, what

    def connection_made(self, transport):
        super().connection_made(transport)
        transport.pause_reading()
        self._linking = asyncio.ensure_future(self._link())  # (the loop holds tasks weakly)

    async def _link(self):
        loop = asyncio.get_running_loop()
        try:
            sock = await self.connect()
            _, other = await loop.create_connection(_Pipe, sock=sock)
        except (OSError, asyncio.TimeoutError) as e:
            log.debug("Relay %s: could not connect: %s", self.what, e)
            self.transport.close()
            return
        if self.transport.is_closing():
            other.transport.close()
            return
        self.link(other)
        other.link(self)


async def _connect_to(addr: Address, netns: Path | None = None) -> socket.socket:
    """A socket connected to ``addr``, on the machine's side or inside ``netns``."""
    loop = asyncio.get_running_loop()
    if netns is None:
        sock = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET)
    else:
        sock = await asyncio.to_thread(sandbox.socket_in_netns, netns,
                                       socket.AF_INET6 if ":" in addr[0] else socket.AF_INET)
    try:
        sock.setblocking(False)
        await asyncio.wait_for(loop.sock_connect(sock, addr), 10)
    except BaseException:
        sock.close()
        raise
    return sock


def _listening(addr: Address, netns: Path | None = None) -> socket.socket:
    """A socket listening on ``addr`` (port 0: any free one), on the machine's side or
    inside ``netns``."""
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    sock = (socket.socket(family) if netns is None
            else sandbox.socket_in_netns(netns, family))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


# -- the relays' thread --------------------------------------------------------------------

class Bridge:
    """The relays of this process: an event loop in a thread of its own (`instance`)."""

    _instance: Bridge | None = None
    _lock = threading.Lock()

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gpulab-netbridge",
                                       daemon=True)
        self.thread.start()

    @classmethod
    def instance(cls) -> Bridge:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    async def run(self, coro):
        """Run ``coro`` on the bridge's loop; await its result from any loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def relay(self, listen: Address, target: Address, *, listen_in: Path | None = None,
                    connect_in: Path | None = None) -> Relay:
        """A relay listening on ``listen`` (inside ``listen_in``, else on the machine's side;
        port 0: a free one) whose connections are piped to ``target`` (inside ``connect_in``,
        else on the machine's side)."""
        what = f"{listen[0]}:{listen[1]}{' (person)' if listen_in else ''} -> " \
               f"{target[0]}:{target[1]}{' (person)' if connect_in else ''}"

        async def make():
            sock = await asyncio.to_thread(_listening, listen, listen_in)
            port = sock.getsockname()[1]
            tgt = (target[0], target[1] or port)
            server = await asyncio.get_running_loop().create_server(
                lambda: _Accepted(lambda: _connect_to(tgt, connect_in), what), sock=sock)
            return Relay(self, server, (listen[0], port))

        return await self.run(make())


@dataclass
class Relay:
    bridge: Bridge
    server: asyncio.base_events.Server
    address: Address

    async def close(self) -> None:
        async def close():
            self.server.close()
            # connections in flight end with their sides (their sockets hold the namespace
            # until then); new ones are refused at once
        await self.bridge.run(close())


# -- one namespace per person --------------------------------------------------------------

@dataclass
class PersonNet:
    name: str
    path: Path
    #: server name -> the relay from the machine's side to it (None until it has a port)
    servers: dict[str, Relay | None] = field(default_factory=dict)
    #: the relays of the hub's and the service's addresses inside the namespace
    inside: dict[Address, Relay] = field(default_factory=dict)
    #: the egress proxy inside it (`gpulab.hub.machine.egress`), and where it listens
    proxy: Any = None
    proxy_address: Address | None = None


class PersonNetworks:
    """The persons' namespaces of this hub, one lock per person (`for_loop`: one registry
    per event loop)."""

    _instances: dict[Any, PersonNetworks] = {}

    def __init__(self, base: Path = sandbox.NETNS_DIR):
        self.base = Path(base)
        self.nets: dict[str, PersonNet] = {}
        self.locks: dict[str, asyncio.Lock] = {}

    @classmethod
    def for_loop(cls, base: Path = sandbox.NETNS_DIR) -> PersonNetworks:
        key = (asyncio.get_running_loop(), str(base))
        if key not in cls._instances:
            cls._instances[key] = cls(base)
        return cls._instances[key]

    def lock(self, name: str) -> asyncio.Lock:
        return self.locks.setdefault(name, asyncio.Lock())

    async def join(self, name: str, server: str, reach: Iterable[Address], *,
                   adopt: bool = False, egress: Iterable[Any] | None = None) -> Path:
        """Register ``server`` in the namespace ``name`` (made, with relays to each of
        ``reach``, if the person has none yet) and return its path, for `sandbox.open_netns`.
        ``adopt``: a server found running (after a hub restart): a namespace kept under
        ``base`` is its own, never made anew. ``egress``: the networks refused besides the
        built-in ones, for an egress proxy inside the namespace (`proxy_address`); None: no
        proxy. Raises `sandbox.SandboxError` / ``OSError``."""
        bridge = Bridge.instance()
        async with self.lock(name):
            net = self.nets.get(name)
            if net is None:
                path = self.base / name
                # one left by a hub that died is nobody's, and made anew, unless a process
                # still runs in it (a server this hub has not polled yet)
                if not (path.exists() and (adopt or await asyncio.to_thread(in_use, path))):
                    await asyncio.to_thread(sandbox.make_netns, name, self.base)
                net = self.nets[name] = PersonNet(name, path)
            try:
                for addr in dict.fromkeys(reach):
                    if addr not in net.inside:
                        net.inside[addr] = await bridge.relay(addr, addr, listen_in=net.path)
                if egress is not None and net.proxy is None:
                    try:
                        await self._open_proxy(bridge, net, list(egress), set(net.inside))
                    except OSError:
                        if not adopt:
                            raise
                        log.exception("No egress proxy in %s", name)
            except BaseException:
                if not net.servers:
                    await self._remove(net)
                raise
            net.servers.setdefault(server, None)
            return net.path

    async def open_server(self, name: str, server: str, ip: str, port: int) -> int:
        """The relay from ``ip:port`` on the machine's side to the server inside the person's
        namespace, at the same address and port; ``port`` 0: one free on both sides. Returns
        the port."""
        bridge = Bridge.instance()
        async with self.lock(name):
            net = self.nets[name]
            old = net.servers.get(server)
            if old is not None:
                await old.close()
            for _ in range(20):
                relay = await bridge.relay((ip, port), (ip, port), connect_in=net.path)
                if port or await asyncio.to_thread(_free_inside, net.path, ip, relay.address[1]):
                    net.servers[server] = relay
                    return relay.address[1]
                await relay.close()  # the person uses that port: another one
            raise OSError(errno.EADDRINUSE, f"no port free for {ip} in {name}")

    async def _open_proxy(self, bridge: Bridge, net: PersonNet, refused: list,
                          taken: set[Address]) -> None:
        from . import egress

        port = egress.PROXY_PORT
        while (egress.PROXY_HOST, port) in taken:  # (a hub or service on 3128)
            port += 1
        proxy = egress.EgressProxy(refused)

        async def start():
            sock = await asyncio.to_thread(_listening, (egress.PROXY_HOST, port), net.path)
            await proxy.start(sock)

        await bridge.run(start())
        net.proxy, net.proxy_address = proxy, (egress.PROXY_HOST, port)

    def proxy_address(self, name: str) -> Address | None:
        """Where the egress proxy of ``name``'s namespace listens inside it (None: none)."""
        net = self.nets.get(name)
        return net.proxy_address if net is not None else None

    def has(self, name: str, server: str) -> bool:
        net = self.nets.get(name)
        return net is not None and server in net.servers

    async def leave(self, name: str, server: str) -> bool:
        """``server`` stopped: its relay closes; the person's last one removes the namespace
        (and one left by a dead hub, which nobody holds). True when it was removed."""
        async with self.lock(name):
            net = self.nets.get(name)
            if net is None:  # (after a hub restart) unless another server still runs in it
                path = self.base / name
                if path.exists() and not await asyncio.to_thread(in_use, path):
                    await asyncio.to_thread(sandbox.remove_netns, name, self.base)
                    return True
                return False
            relay = net.servers.pop(server, None)
            if relay is not None:
                await relay.close()
            if net.servers:
                return False
            await self._remove(net)
            return True

    async def _remove(self, net: PersonNet) -> None:
        for relay in net.inside.values():
            await relay.close()
        net.inside.clear()
        if net.proxy is not None:
            await Bridge.instance().run(net.proxy.close())
            net.proxy = net.proxy_address = None
        self.nets.pop(net.name, None)
        await asyncio.to_thread(sandbox.remove_netns, net.name, self.base)


def in_use(path: Path) -> bool:
    """Whether a process of the machine runs in the namespace kept at ``path`` (a look at
    every process's ``/proc/<pid>/ns/net``, as root)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    want = (st.st_dev, st.st_ino)
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                ns = os.stat(f"/proc/{pid}/ns/net")
            except OSError:
                continue
            if (ns.st_dev, ns.st_ino) == want:
                return True
    return False


def free_ports_inside(path: Path, count: int, ip: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``ip`` inside the namespace at ``path`` now (the
    kernel's choice of free ports, all bound at once so none is given twice)."""
    socks = []
    try:
        for _ in range(count):
            sock = sandbox.socket_in_netns(path, socket.AF_INET6 if ":" in ip else socket.AF_INET)
            socks.append(sock)
            sock.bind((ip, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _free_inside(path: Path, ip: str, port: int) -> bool:
    """Whether ``ip:port`` is free inside the namespace at ``path``."""
    sock = sandbox.socket_in_netns(path, socket.AF_INET6 if ":" in ip else socket.AF_INET)
    try:
        sock.bind((ip, port))
        return True
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return False
        raise
    finally:
        sock.close()


__all__ = ["Bridge", "NetworkUnusable", "PersonNetworks", "Relay", "free_ports_inside",
           "loopback_address"]
