"""Issue 12 item 4: a person's TensorBoard is reachable only through their own server.

TensorBoard has no login. It listens on a Unix socket in a fresh 0700 folder of the server's
account (jupyter-server-proxy's ``unix_socket``), never on a TCP port: eve finds no port of
vic's TensorBoard, cannot connect to its socket, and her token is refused on vic's server.
The same for TensorBoard's own ``%tensorboard`` magic (``gpulab.extensions.tbmagic``): its
TensorBoard serves on a Unix socket in another 0700 folder of the server's account, shown
through ``<prefix>gpulab-tensorboard/<key>/``. Neither starts TensorBoard's fast data server
(a gRPC server on a loopback TCP port).
"""

import contextlib
import json
import os
import re
import stat
import time
import uuid

import psutil
import pytest
import requests
import websocket

pytestmark = pytest.mark.security


def tensorboard_of(person, module="gpulab.extensions.serverext"):
    """The TensorBoard process of `person`'s server (root's view): gpulab's own, or with
    ``module="gpulab.extensions.tbmagic"`` the one the ``%tensorboard`` magic started."""
    uid = person.account.pw_uid
    for p in psutil.process_iter(["cmdline", "uids"]):
        cmd = p.info["cmdline"] or []
        if p.info["uids"] and p.info["uids"].real == uid and module in cmd:
            return p
    return None


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                out.add(link[len("socket:["):-1])
    return out


def tcp_listeners(proc):
    """TCP sockets listened on by `proc` or any process under it, read from the ``/proc/net``
    of its own network namespace (psutil reads the machine's, where a server in its person's
    own namespace has none)."""
    found = []
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            inodes = _socket_inodes(p.pid)
            for table in ("tcp", "tcp6"):
                for line in open(f"/proc/{p.pid}/net/{table}").readlines()[1:]:
                    f = line.split()
                    if f[3] == "0A" and f[9] in inodes:
                        found.append((p.pid, p.name(), f[1]))
    return found


def unix_sockets(proc) -> list[str]:
    """The paths of the Unix sockets `proc` holds (from its own namespace's ``/proc/net``)."""
    inodes = _socket_inodes(proc.pid)
    out = []
    for line in open(f"/proc/{proc.pid}/net/unix").readlines()[1:]:
        f = line.split()
        if len(f) > 7 and f[6] in inodes:
            out.append(f[7])
    return out


def test_tensorboard_has_no_port_and_only_its_owner_reaches_it(hub, vic, eve):
    base = f"{hub.user_url('vic')}tensorboard/"
    r = requests.get(base, headers={"Authorization": f"token {vic.token()}"}, timeout=180)
    assert r.status_code == 200 and "TensorBoard" in r.text, (r.status_code, r.text[:300])
    tb = tensorboard_of(vic)
    assert tb is not None, "vic's TensorBoard process was not found"

    # no TCP listener at all (nor of a data server under it); a Unix socket in a folder only
    # vic's account may enter
    assert tcp_listeners(tb) == []
    sock = tb.cmdline()[tb.cmdline().index("--unix-socket") + 1]
    r = eve.sh(f"python3 - <<'PY'\nimport socket\ns = socket.socket(socket.AF_UNIX)\n"
               f"try:\n    s.connect({sock!r}); print('CONNECTED')\n"
               f"except OSError as e:\n    print('REFUSED', e.errno)\nPY\n"
               "ss -ltnpH 2>/dev/null | grep -c tensorboard || true")
    # EACCES (the 0700 folder), or ENOENT where vic's server has a /tmp of its own
    assert "CONNECTED" not in r.stdout and ("REFUSED 13" in r.stdout or "REFUSED 2" in r.stdout), r
    assert r.stdout.split()[-1] == "0"  # no TCP listener named tensorboard either
    # the folder as vic's server sees it: vic's, 0700
    folder = os.stat(f"/proc/{tb.pid}/root{os.path.dirname(sock)}")
    assert (folder.st_uid, stat.S_IMODE(folder.st_mode)) == (vic.account.pw_uid, 0o700)

    # eve's own valid token is refused by vic's server; no token: sent to log in
    r = requests.get(base + "data/runs", headers={"Authorization": f"token {eve.token()}"},
                     allow_redirects=False, timeout=30)
    assert r.status_code == 403, r.status_code
    r = requests.get(base + "data/runs", allow_redirects=False, timeout=30)
    assert r.status_code in (302, 401, 403)
    # vic still has her TensorBoard
    r = requests.get(base + "data/runs", headers={"Authorization": f"token {vic.token()}"},
                     timeout=60)
    assert r.status_code == 200 and isinstance(r.json(), list)


# -- TensorBoard's own %tensorboard magic ---------------------------------------------------

@contextlib.contextmanager
def kernel_of(person):
    """A kernel in `person`'s default server, kept alive while the block runs (the magic's
    TensorBoard is the kernel's child); yields ``run(code) -> printed text``."""
    base = f"{person.hub.user_url(person.name)}"
    h = {"Authorization": f"token {person.token()}"}
    k = requests.post(base + "api/kernels", headers=h, json={"name": "python3"}, timeout=60)
    assert k.status_code == 201, (k.status_code, k.text)
    kid = k.json()["id"]
    ws = websocket.create_connection(
        base.replace("http", "ws", 1) + f"api/kernels/{kid}/channels",
        header=[f"Authorization: token {person.token()}"], timeout=150)

    def run(code, timeout=150):
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "t",
                       "session": uuid.uuid4().hex, "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": False,
                        "user_expressions": {}, "allow_stdin": False}}))
        out, deadline = [], time.time() + timeout
        while time.time() < deadline:
            m = json.loads(ws.recv())
            if m.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if m["msg_type"] == "stream":
                out.append(m["content"]["text"])
            elif m["msg_type"] == "error":
                raise AssertionError("kernel error: " + "\n".join(m["content"]["traceback"]))
            elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                return "".join(out)
        raise TimeoutError("kernel did not answer")

    try:
        yield run
    finally:
        ws.close()
        requests.delete(base + f"api/kernels/{kid}", headers=h, timeout=60)


# what a person types in a cell, then what the cell showed (the magic's output is display
# data: captured here and printed), and a run of scalars for it to show, written as vic
MAGIC_CELL = """
import json, os, time
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter
logdir = os.path.join(os.environ.get("GPULAB_USER_DIR") or os.getcwd(), "magic-runs")
w = EventFileWriter(os.path.join(logdir, "train"))
for step, v in enumerate((3.0, 2.0, 1.0)):
    w.add_event(Event(step=step, wall_time=time.time(),
                      summary=Summary(value=[Summary.Value(tag="loss", simple_value=v)])))
w.close()
%load_ext tensorboard
from IPython.utils.capture import capture_output
with capture_output() as cap:
    get_ipython().run_line_magic("tensorboard", "--logdir " + logdir)
print(json.dumps({"shown": [str(o.data) for o in cap.outputs] + [cap.stdout],
                  "binary": os.environ.get("TENSORBOARD_BINARY"),
                  "proxy": os.environ.get("TENSORBOARD_PROXY_URL")}))
"""

EVE_CONNECTS = """python3 - <<'PY'
import socket, sys
path, key = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(path); print("SOCKET CONNECTED")
except OSError as e:
    print("SOCKET REFUSED", e.errno)
for host in ("127.0.0.1", "::1"):
    try:
        c = socket.create_connection((host, key), timeout=5)
        c.sendall(b"GET /data/runs HTTP/1.0\\r\\n\\r\\n")
        print("TCP", host, c.recv(4096).decode(errors="replace").replace("\\n", " "))
    except OSError as e:
        print("TCP REFUSED", host, e.errno)
PY
"""


def test_tensorboard_magic_has_no_port_and_only_its_owner_reaches_it(hub, vic, eve):
    with kernel_of(vic) as run:
        shown = json.loads(run(MAGIC_CELL).strip().splitlines()[-1])
        text = " ".join(shown["shown"])
        # the magic launched gpulab's launcher and shows its iframe at vic's own route
        assert shown["proxy"] == "/user/vic/gpulab-tensorboard/%PORT%/", shown
        assert "ERROR" not in text, text
        m = re.search(r"/user/vic/gpulab-tensorboard/(\d+)/", text)
        assert m, text
        key = int(m.group(1))

        tb = tensorboard_of(vic, "gpulab.extensions.tbmagic")
        assert tb is not None, "the magic's TensorBoard of vic was not found"
        # nothing of it listens on TCP (no data server either); it serves a Unix socket in a
        # folder of vic's account that no one else may enter
        assert tcp_listeners(tb) == []
        socks = [path for path in unix_sockets(tb) if path.endswith(f"/{key}.sock")]
        assert len(socks) == 1, unix_sockets(tb)
        sock = socks[0]
        assert os.path.dirname(sock) == os.path.dirname(shown["binary"])
        folder = os.stat(f"/proc/{tb.pid}/root{os.path.dirname(sock)}")
        assert (folder.st_uid, stat.S_IMODE(folder.st_mode)) == (vic.account.pw_uid, 0o700)

        # vic sees her TensorBoard, with her run, through her server
        base = f"{hub.user_url('vic')}gpulab-tensorboard/{key}/"
        vh = {"Authorization": f"token {vic.token()}"}
        r = requests.get(base, headers=vh, timeout=60)
        assert r.status_code == 200 and "TensorBoard" in r.text, (r.status_code, r.text[:300])
        deadline, runs = time.time() + 60, []
        while time.time() < deadline and "train" not in runs:
            runs = requests.get(base + "data/runs", headers=vh, timeout=30).json()
            time.sleep(1)
        assert "train" in runs, runs

        # eve: her token on vic's server is refused, no token is sent to log in
        r = requests.get(base + "data/runs", headers={"Authorization": f"token {eve.token()}"},
                         allow_redirects=False, timeout=30)
        assert r.status_code == 403, r.status_code
        r = requests.get(base + "data/runs", allow_redirects=False, timeout=30)
        assert r.status_code in (302, 401, 403), r.status_code
        # the same key through eve's own server is not vic's TensorBoard
        r = requests.get(f"{hub.user_url('eve')}gpulab-tensorboard/{key}/data/runs",
                         headers={"Authorization": f"token {eve.token()}"}, timeout=30)
        assert r.status_code == 404, (r.status_code, r.text[:200])
        # from eve's account: the socket is out of reach, and the "port" the magic reports
        # is no TCP port of vic's TensorBoard
        r = eve.sh(EVE_CONNECTS.replace("python3 -", f"python3 - {sock} {key}"))
        assert "SOCKET CONNECTED" not in r.stdout, r
        assert "SOCKET REFUSED 13" in r.stdout or "SOCKET REFUSED 2" in r.stdout, r
        assert r.stdout.count("TCP REFUSED") == 2 or '"train"' not in r.stdout, r

        # vic is untouched: her TensorBoard still runs and still serves her
        assert tb.is_running()
        r = requests.get(base + "data/runs", headers=vh, timeout=30)
        assert r.status_code == 200 and "train" in r.json()
