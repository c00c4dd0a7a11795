"""Forward TCP ports of loopback in a network namespace to the same ports of this one's loopback.

The cluster tier's real node runs in a network namespace of its own (``node.py``), so that its
bridge, routes and packet filters vanish with it. Its kubelet, kube-proxy and cluster DNS reach the
control plane, which listens only on this namespace's loopback, through this forwarder: it opens
its listening sockets inside the node's namespace (``setns`` on this thread, then back) and makes
the outgoing connections here.

    python -m tests.cluster.nsforward /run/netns/NAME PORT [PORT ...]

It prints ``ready`` once listening, and ends with its parent (``PR_SET_PDEATHSIG``) or on SIGTERM.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import sys

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def listen_in(netns: str, ports: list[int]) -> list[socket.socket]:
    """Listening sockets on 127.0.0.1:PORT inside the namespace at ``netns``."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(netns, os.O_RDONLY)
    try:
        _setns(target)
        try:
            return [socket.create_server(("127.0.0.1", p), reuse_port=False) for p in ports]
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(target)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except Exception:
            pass


async def serve(listeners: list[socket.socket]) -> None:
    async def handler(port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    servers = []
    for sock in listeners:
        port = sock.getsockname()[1]
        servers.append(await asyncio.start_server(
            lambda r, w, port=port: handler(port, r, w), sock=sock))
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: end with the test process
    listeners = listen_in(argv[0], [int(p) for p in argv[1:]])
    asyncio.run(serve(listeners))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
