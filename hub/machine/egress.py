"""Notebooks' way out to the network: an HTTP proxy inside each person's namespace.

A person's network namespace (`gpulab.hub.machine.personnet`) holds only loopback, so what a
server serves is its person's alone; but then ``pip install``, a data set download
(``tf.keras.datasets.mnist.load_data()``), ``git clone`` or ``wget`` fail too. Opening the
namespace to the machine's network (a veth pair and NAT) would let a kernel reach every
address of the machine again, other people's servers with them (what the namespace closed),
and the cloud's metadata service (credentials). Instead the hub's relay loop (`Bridge`)
listens inside the namespace on ``127.0.0.1:3128`` (`PROXY_PORT`) as an HTTP proxy, and the
server's environment names it (``HTTP_PROXY``, ``HTTPS_PROXY`` and their lower-case forms,
which pip, conda, requests, urllib, curl, wget and git all follow), with ``NO_PROXY`` for
loopback (the hub and the gpulab service, relayed into the namespace, are reached directly).

It handles ``CONNECT host:port`` (HTTPS, and anything tunnelled: TLS runs end to end, the
proxy sees no content) and plain absolute-form requests (``GET http://host/path``: forwarded
as HTTP/1.1 with ``Connection: close``, the answer piped back). Each destination name is
resolved by the hub (``getaddrinfo``, in a thread), every address it resolves to is checked
(`refusal`), and the proxy connects to an address it checked (a name that resolves to
something else a moment later changes nothing: no DNS rebinding gap). Refused, with a 403 and
the reason: the machine's own addresses (loopback, every address of its interfaces: other
people's servers and the hub's ports are there) and the networks they are on (containers
and VMs on a bridge of the machine, its LAN's neighbours), link-local ``169.254.0.0/16`` and
``fe80::/10`` (the cloud's metadata service), the shared address space ``100.64.0.0/10``,
Azure's wire server ``168.63.129.16``, Alibaba's metadata ``100.100.100.200``, unspecified,
multicast and reserved addresses, and IPv6 forms that carry an IPv4 address (mapped,
compatible, NAT64, 6to4) are judged by that IPv4 address; plus the operator's own list
(``c.LocalGPUSpawner.egress_refused_networks``, e.g. the machine's LAN).

Limits: at most `MAX_CONNECTIONS` connections at once per person (a 503 beyond), a tunnel
idle (nothing either way) for `IDLE_TIMEOUT` seconds is closed, a request head is at most
64 KiB read within 30 s; all of a person's connections close with their namespace.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

import psutil

log = logging.getLogger(__name__)

PROXY_HOST = "127.0.0.1"
PROXY_PORT = 3128
#: connections at once per person
MAX_CONNECTIONS = 256
#: seconds a connection may carry nothing either way
IDLE_TIMEOUT = 300.0
#: seconds to send a request head, and its most bytes
HEAD_TIMEOUT = 30.0
HEAD_LIMIT = 64 * 1024
CONNECT_TIMEOUT = 15.0

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
IP = ipaddress.IPv4Address | ipaddress.IPv6Address

#: networks refused whatever the operator adds, with the reason given
ALWAYS_REFUSED: list[tuple[Network, str]] = [
    (ipaddress.ip_network(n), why) for n, why in [
        ("0.0.0.0/8", "an unspecified address"),
        ("127.0.0.0/8", "a loopback address (this machine)"),
        ("169.254.0.0/16", "a link-local address (the cloud's metadata service)"),
        ("100.64.0.0/10", "the shared address space (providers' internal endpoints)"),
        ("168.63.129.16/32", "Azure's wire server"),
        ("100.100.100.200/32", "Alibaba Cloud's metadata service"),
        ("224.0.0.0/4", "a multicast address"),
        ("240.0.0.0/4", "a reserved address"),
        ("::/128", "an unspecified address"),
        ("::1/128", "a loopback address (this machine)"),
        ("fe80::/10", "a link-local address"),
        ("fec0::/10", "a site-local address"),
        ("ff00::/8", "a multicast address"),
        ("fd00:ec2::/32", "AWS's metadata service (IPv6)"),
    ]
]

_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
_COMPATIBLE = ipaddress.ip_network("::/96")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


def embedded_ipv4(ip: IP) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, compatible, NAT64, 6to4), if any."""
    if ip.version != 6:
        return None
    if ip in _MAPPED or ip in _COMPATIBLE or ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    return None


def machine_addresses() -> set[IP]:
    """Every address of the machine's own interfaces."""
    return {ipaddress.ip_address(a) for a, _ in _interface_addresses()}


def machine_networks() -> list[Network]:
    """The networks the machine's interfaces are on (each address with its netmask): the
    machine's own addresses, and what is attached to it directly (containers and VMs on a
    bridge of the machine, the neighbours on its LAN)."""
    return list(dict.fromkeys(n for _, n in _interface_addresses()))


def _interface_addresses() -> list[tuple[str, Network]]:
    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                addr = a.address.split("%", 1)[0]
                mask = (a.netmask or "").split("%", 1)[0].split("/")[0]
                if ":" in mask:  # (IPv6 takes a prefix length, not a mask)
                    try:
                        mask = str(bin(int(ipaddress.IPv6Address(mask))).count("1"))
                    except ValueError:
                        mask = ""
                try:
                    net = ipaddress.ip_network(f"{addr}/{mask}" if mask else addr, strict=False)
                except ValueError:
                    try:
                        net = ipaddress.ip_network(addr)
                    except ValueError:
                        continue
                out.append((addr, net))
    return out


def refusal(ip: IP | str, refused: Iterable[Network] = (),
            local: Iterable[IP | Network] | None = None) -> str | None:
    """Why a notebook may not connect to ``ip``, or None when it may. ``refused``: the
    operator's networks; ``local``: the machine's addresses or networks (`machine_networks`
    if None)."""
    ip = ipaddress.ip_address(ip)
    if ip.version == 6 and ip.scope_id:
        return "a scoped address"
    inner = embedded_ipv4(ip)
    if inner is not None:
        if ip in _COMPATIBLE and int(ip) <= 1:
            pass  # :: and ::1 are judged as they are
        else:
            why = refusal(inner, refused, local)
            return f"{why} (in an IPv6 address)" if why else None
    if ip in _NAT64_LOCAL:
        return "a local NAT64 address"
    for net, why in ALWAYS_REFUSED:
        if ip.version == net.version and ip in net:
            return why
    for net in (machine_networks() if local is None else local):
        net = ipaddress.ip_network(net)
        if ip.version == net.version and ip in net:
            return ("an address of this machine" if net.num_addresses == 1 else
                    f"on {net}, a network of this machine's interfaces")
    for net in refused:
        if ip.version == net.version and ip in net:
            return f"in {net}, which this hub refuses"
    return None


def parse_networks(cidrs: Iterable[str]) -> list[Network]:
    """The operator's CIDRs (``ValueError`` naming a bad one)."""
    out = []
    for c in cidrs:
        try:
            out.append(ipaddress.ip_network(str(c).strip(), strict=False))
        except ValueError as e:
            raise ValueError(f"egress_refused_networks: {c!r} is not a network ({e})") from e
    return out


class Refused(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


async def open_checked(host: str, port: int, refused: list[Network]):
    """A connection (reader, writer) to ``host:port`` on an address that passed `refusal`
    (the one resolved and checked is the one connected to). Raises `Refused`."""
    if not (0 < port < 65536):
        raise Refused(400, f"bad port {port}")
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise Refused(502, f"cannot resolve {host}: {e}") from e
    local = await asyncio.to_thread(machine_networks)
    reasons, last = [], None
    for family, type_, proto, _, sockaddr in infos:
        ip = sockaddr[0]
        why = refusal(ip, refused, local)
        if why:
            reasons.append(f"{ip} is {why}")
            continue
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, sockaddr), CONNECT_TIMEOUT)
            return await asyncio.open_connection(sock=sock, limit=HEAD_LIMIT)
        except (OSError, asyncio.TimeoutError) as e:
            sock.close()
            last = e
    if last is not None:
        raise Refused(502, f"cannot connect to {host}:{port}: {last or 'timed out'}")
    raise Refused(403, f"{host}:{port} is refused: " + "; ".join(dict.fromkeys(reasons)))


class EgressProxy:
    """The proxy of one person's namespace, on the relays' loop (`start`, `close`)."""

    def __init__(self, refused: Iterable[Network] = (), *, max_connections: int | None = None,
                 idle_timeout: float | None = None):
        self.refused = list(refused)
        self.max_connections = max_connections or MAX_CONNECTIONS
        self.idle_timeout = idle_timeout or IDLE_TIMEOUT
        self.server: asyncio.base_events.Server | None = None
        self.tasks: set[asyncio.Task] = set()
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock`` (listening, made inside the namespace)."""
        self.server = await asyncio.start_server(self._client, sock=sock, limit=HEAD_LIMIT)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in list(self.writers):
            w.close()
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        self.tasks.add(task)
        self.writers.add(writer)
        try:
            if len(self.tasks) > self.max_connections:
                await _answer(writer, 503, "too many connections through the proxy at once")
                return
            await self._serve(reader, writer)
        except Refused as e:
            await _answer(writer, e.status, e.reason)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                asyncio.TimeoutError) as e:
            log.debug("egress proxy: %s", e)
        finally:
            self.tasks.discard(task)
            self.writers.discard(writer)
            writer.close()

    async def _serve(self, reader, writer):
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        except asyncio.LimitOverrunError:
            raise Refused(431, "request head too long") from None
        except asyncio.TimeoutError:
            raise Refused(408, "no request") from None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise Refused(400, "not an HTTP/1 request")
        method, target, _ = parts
        if method == "CONNECT":
            host, port = _host_port(target, None)
            r, w = await open_checked(host, port, self.refused)
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await self._pipe(reader, writer, r, w)
            return
        u = urlsplit(target)
        if u.scheme != "http" or not u.hostname:
            raise Refused(400, "only CONNECT and absolute http:// requests go through this "
                               "proxy (https:// URLs use CONNECT)")
        try:
            port = u.port or 80
        except ValueError:
            raise Refused(400, "bad port") from None
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        headers = [line for line in lines[1:] if line and not line.lower().startswith(
            ("proxy-", "connection:", "keep-alive:"))]
        if not any(h.lower().startswith("host:") for h in headers):
            headers.insert(0, f"Host: {u.netloc.rsplit('@', 1)[-1]}")
        r, w = await open_checked(u.hostname, port, self.refused)
        w.write("\r\n".join([f"{method} {path} HTTP/1.1", *headers, "Connection: close",
                             "", ""]).encode("latin-1"))
        await self._pipe(reader, writer, r, w)

    async def _pipe(self, r1, w1, r2, w2):
        """Both ways until both ended, or nothing moved for `idle_timeout` seconds."""
        self.writers.add(w2)
        last = [time.monotonic()]

        async def copy(r, w):
            while True:
                try:
                    data = await asyncio.wait_for(r.read(65536), self.idle_timeout)
                except asyncio.TimeoutError:
                    if time.monotonic() - last[0] >= self.idle_timeout:
                        raise
                    continue
                if not data:
                    if w.can_write_eof() and not w.is_closing():
                        w.write_eof()
                    return
                last[0] = time.monotonic()
                w.write(data)
                await w.drain()

        try:
            await asyncio.gather(copy(r1, w2), copy(r2, w1))
        finally:
            self.writers.discard(w2)
            w2.close()


def _host_port(target: str, default: int | None) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        if default is None:
            raise Refused(400, "CONNECT needs host:port")
        host, port = target, str(default)
    host = host.strip("[]")
    if not host:
        raise Refused(400, "no host")
    return host, int(port)


async def _answer(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    titles = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout",
              431: "Request Header Fields Too Large", 502: "Bad Gateway",
              503: "Service Unavailable"}
    body = f"gpulab egress proxy: {reason}\n".encode()
    try:
        writer.write(f"HTTP/1.1 {status} {titles.get(status, 'Error')}\r\n"
                     f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)
        await asyncio.wait_for(writer.drain(), 5)
    except (OSError, asyncio.TimeoutError):
        pass


def proxy_env(proxy: tuple[str, int], direct: Iterable[str] = ()) -> dict[str, str]:
    """The environment that sends a server's HTTP(S) through ``proxy``; ``direct``: hosts
    reached without it (loopback, the hub's and the service's addresses)."""
    url = f"http://{proxy[0]}:{proxy[1]}"
    no = ",".join(dict.fromkeys(["localhost", "127.0.0.1", "::1", *direct]))
    return {"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
            "NO_PROXY": no, "no_proxy": no}


__all__ = ["EgressProxy", "PROXY_HOST", "PROXY_PORT", "Refused", "machine_addresses",
           "machine_networks",
           "open_checked", "parse_networks", "proxy_env", "refusal"]
