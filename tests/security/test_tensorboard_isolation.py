"""Issue 12 item 4: a person's TensorBoard is reachable only through their own server.

TensorBoard has no login. It listens on a Unix socket in a fresh 0700 folder of the server's
account (jupyter-server-proxy's ``unix_socket``), never on a TCP port: eve finds no port of
vic's TensorBoard, cannot connect to its socket, and her token is refused on vic's server.
"""

import os
import stat

import psutil
import pytest
import requests

pytestmark = pytest.mark.security


def tensorboard_of(person):
    """The TensorBoard process of `person`'s server (root's view)."""
    uid = person.account.pw_uid
    for p in psutil.process_iter(["cmdline", "uids"]):
        cmd = p.info["cmdline"] or []
        if p.info["uids"] and p.info["uids"].real == uid and "gpulab.extensions.serverext" in cmd:
            return p
    return None


def test_tensorboard_has_no_port_and_only_its_owner_reaches_it(hub, vic, eve):
    base = f"{hub.url}/user/vic/tensorboard/"
    r = requests.get(base, headers={"Authorization": f"token {vic.token()}"}, timeout=180)
    assert r.status_code == 200 and "TensorBoard" in r.text, (r.status_code, r.text[:300])
    tb = tensorboard_of(vic)
    assert tb is not None, "vic's TensorBoard process was not found"

    # no TCP listener at all; a Unix socket in a folder only vic's account may enter
    assert [c for c in tb.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN] == []
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
