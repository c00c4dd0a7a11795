"""Notebook servers, accounts, control groups and GPU devices (issue 12 items 2, 5, 7, 8, 10, 11).

Each test attacks one real `gpulab up` (as root, 4 simulated GPUs; one hub for the module) as a
second person, and checks that the attack fails and that the victim's files, server and GPUs
are untouched:

- item 2: a person who signs up as exactly the name another's account is made of gets an
  account of their own; an existing account made for someone else (as a hash collision would
  give), or not made by gpulab, is never handed out;
- items 5 and 8: servers' control groups are named unambiguously (``dave`` + ``x-default`` vs
  ``dave-x`` + default), and stop kills everything in its own group only, a ``setsid nohup``
  grandchild too;
- item 7: a server may open only its own GPU's device node (stand-in nodes made with mknod:
  ENXIO = the cgroup let it through to a missing driver, EPERM = the cgroup refused), also
  without ``CUDA_VISIBLE_DEVICES``;
- item 10: nothing in the data folder is readable by another account;
- item 11: every server has a private /tmp.

And issue 33 items 1, 5 and 8 (hidepid), eve attacking vic from her shell and her server:

- item 1: vic's kernels speak over Unix sockets in her server's private runtime folder; eve's
  ZeroMQ subscriber on every loopback port of vic's account reads nothing, and the sockets
  cannot be connected to by eve;
- item 5: each server has its own IPC namespace and /dev/shm (a file, a System V segment,
  a name squatted in advance);
- item 8: a server's /proc lists only its own account's processes.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
import uuid

import pytest
import requests

from gpulab.hub.machine.accounts import delete_account, system_username
from gpulab.hub.machine.cgroups import Cgroups
from tests.app.hubctl import Browser, pid_exists
from tests.conftest import PASSWORD

pytestmark = pytest.mark.security


def person(hub, admin, name) -> Browser:
    """A hub user who signed up, was approved and logged in (no server yet)."""
    b = Browser(hub, name)
    r = b.signup(PASSWORD)
    assert r.status_code == 200, r.text[:300]
    assert admin.approve(name).status_code == 200
    b.login(PASSWORD)
    return b


def probe(b: Browser, server: str = "") -> dict:
    """Who the server runs as, its pid and its control group, seen from its kernel."""
    return json.loads(b.run_in_kernel(
        "import json, os\n"
        "print(json.dumps({'uid': os.getuid(), 'ppid': os.getppid(),\n"
        "                  'cgroup': open('/proc/self/cgroup').read(),\n"
        "                  'home': os.environ.get('HOME'), 'dir': os.environ.get('GPULAB_USER_DIR')}))",
        server=server))


def require_cgroups() -> Cgroups:
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, f"control groups are needed here and missing: {why}"
    return cgroups


def gpulab_group(cgroup_text: str) -> str:
    """The gpulab group a /proc/<pid>/cgroup text names (that of the memory hierarchy)."""
    for line in cgroup_text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") or controllers == "":
            assert "/gpulab/" in path, cgroup_text
            return path.rsplit("/", 1)[1]
    raise AssertionError(cgroup_text)


# -- item 2: the name mapping is injective and checked ------------------------------------

def test_a_mapped_name_does_not_get_carols_account_or_folder(hub, admin, prefix):
    carol = person(hub, admin, "carol.x")
    assert carol.start_server("", {"profile": "cpu"}).status_code in (201, 202)
    seen = probe(carol)
    carols = pwd.getpwnam(system_username(prefix, "carol.x"))
    assert seen["uid"] == carols.pw_uid
    secret = uuid.uuid4().hex
    carol.run_in_kernel(
        f"import os; open(os.environ['GPULAB_USER_DIR'] + '/secret.txt', 'w').write({secret!r})")
    carol_dir = seen["dir"]
    before = {p: os.stat(os.path.join(carol_dir, p)) for p in os.listdir(carol_dir)}

    # mallory signs up as exactly the name carol.x maps to
    mapped = system_username(prefix, "carol.x")[len(prefix):]
    mallory = person(hub, admin, mapped)
    r = mallory.start_server("", {"profile": "cpu"})
    if r.status_code in (201, 202):
        theirs = probe(mallory)
        assert theirs["uid"] != carols.pw_uid
        assert theirs["dir"] != carol_dir and theirs["home"] != carols.pw_dir
        out = mallory.run_in_kernel(
            "import os\n"
            f"for p in ({carol_dir!r} + '/secret.txt', {carols.pw_dir!r}):\n"
            "    try:\n"
            "        open(p).read() if os.path.isfile(p) else os.listdir(p); print('READ', p)\n"
            "    except PermissionError:\n"
            "        print('denied')\n")
        assert "READ" not in out, out
        mallory.stop_server()
    else:
        assert r.status_code == 403, r.text
    # carol's account, folder and file are as they were
    assert pwd.getpwnam(system_username(prefix, "carol.x")) == carols
    assert {p: os.stat(os.path.join(carol_dir, p)) for p in os.listdir(carol_dir)} == before
    assert open(os.path.join(carol_dir, "secret.txt")).read() == secret
    assert probe(carol)["uid"] == carols.pw_uid
    carol.stop_server()


def test_an_account_made_for_someone_else_is_never_handed_out(hub, admin, prefix):
    """What a hash collision (or a system account of the machine) would give: the account
    a new hub user maps to exists already, made for carol.x / not by gpulab. Spawn refused."""
    for name, comment in (("trudy", "gpulab user carol.x"), ("zed", "the machine's own user")):
        account = system_username(prefix, name)
        subprocess.run(["useradd", "--create-home", "--user-group", "--comment", comment,
                        account], check=True, capture_output=True)
        try:
            before = pwd.getpwnam(account)
            p = person(hub, admin, name)
            r = p.start_server("", {"profile": "cpu"})
            assert r.status_code == 403, (r.status_code, r.text)
            assert account in r.json()["message"], r.text
            assert pwd.getpwnam(account) == before
            assert not p.api("GET", f"/users/{name}").json()["servers"]
            # a training job (run as the same account by the gpulab service): refused too
            r = p.service("POST", "jobs", json={
                "name": "grab", "strategy": "multi-worker-mirrored",
                "replicas": {"worker": 1}, "source": "print('mine now')"})
            assert r.status_code == 403, (r.status_code, r.text)
            assert account in r.json()["message"], r.text
            assert p.service("GET", "jobs").json()["jobs"] == []
            assert pwd.getpwnam(account) == before
        finally:
            delete_account(account)


# -- items 5 and 8: one control group per server, killed whole on stop ------------------

def test_servers_with_look_alike_names_have_their_own_groups(hub, admin):
    """``dave`` + ``x-default`` vs ``dave-x`` + default: stopping one leaves the other."""
    require_cgroups()
    dave, davex = person(hub, admin, "dave"), person(hub, admin, "dave-x")
    assert dave.start_server("x-default", {"profile": "cpu"}).status_code in (201, 202)
    assert davex.start_server("", {"profile": "cpu"}).status_code in (201, 202)
    a, b = probe(dave, "x-default"), probe(davex)
    assert gpulab_group(a["cgroup"]) != gpulab_group(b["cgroup"])

    dave.stop_server("x-default")
    assert pid_exists(b["ppid"]), "dave-x's server was killed by dave's stop"
    assert probe(davex)["ppid"] == b["ppid"]
    # and the other way round
    assert dave.start_server("x-default", {"profile": "cpu"}).status_code in (201, 202)
    a = probe(dave, "x-default")
    davex.stop_server()
    assert pid_exists(a["ppid"])
    assert probe(dave, "x-default")["ppid"] == a["ppid"]
    dave.stop_server("x-default")


def test_a_setsid_grandchild_does_not_outlive_stop(hub, admin, vic):
    require_cgroups()
    frank = person(hub, admin, "frank")
    assert frank.start_server("", {"profile": "cpu"}).status_code in (201, 202)
    out = frank.run_in_kernel(
        "import subprocess, time\n"
        "p = subprocess.Popen(['bash', '-c', 'setsid nohup sleep 1000 >/dev/null 2>&1 & echo $!'],\n"
        "                     stdout=subprocess.PIPE, text=True)\n"
        "print(p.communicate()[0].strip())\n")
    daemon = int(out.strip())
    time.sleep(0.5)
    assert pid_exists(daemon)
    assert os.getsid(daemon) == daemon  # it left the server's session
    vic_before = probe(vic)
    frank.stop_server()
    deadline = time.time() + 10
    while pid_exists(daemon) and time.time() < deadline:
        time.sleep(0.1)
    assert not pid_exists(daemon), "the daemon outlived its server's stop"
    assert probe(vic)["ppid"] == vic_before["ppid"]  # the victim's server is untouched


# -- item 7: GPUs enforced by the kernel --------------------------------------------------

def test_a_server_opens_only_its_own_gpus(hub, vic, eve):
    cgroups = require_cgroups()
    assert cgroups.devices_enforced, cgroups.devices_why
    # stand-in device nodes (no NVIDIA driver here), where every server can reach them
    dev = hub.data_dir / "shared" / "datasets" / f"dev-{uuid.uuid4().hex[:6]}"
    dev.mkdir(mode=0o755)
    for minor in range(4):
        os.mknod(dev / f"nvidia{minor}", 0o666 | stat.S_IFCHR, os.makedev(195, minor))
        os.chmod(dev / f"nvidia{minor}", 0o666)
    (dev / "probe.py").write_text(
        "import errno, json, os, sys\n"
        "out = {}\n"
        "for m in range(4):\n"
        "    try:\n"
        "        os.close(os.open(os.path.join(os.path.dirname(__file__), f'nvidia{m}'), os.O_RDWR))\n"
        "        out[m] = 'opened'\n"
        "    except OSError as e:\n"
        "        out[m] = errno.errorcode[e.errno]\n"
        "print(json.dumps(out))\n")
    (dev / "probe.py").chmod(0o644)
    code = (
        "import json, os, subprocess, sys\n"
        f"probe = {str(dev / 'probe.py')!r}\n"
        "plain = subprocess.run([sys.executable, probe], capture_output=True, text=True)\n"
        "unset = subprocess.run(['env', '-u', 'CUDA_VISIBLE_DEVICES', sys.executable, probe],\n"
        "                       capture_output=True, text=True)\n"
        "print(json.dumps({'gpus': [g['index'] for g in json.loads(os.environ['GPULAB_GPUS'])],\n"
        "                  'plain': json.loads(plain.stdout), 'unset': json.loads(unset.stdout)}))\n"
    )
    try:
        for who in (vic, eve):
            seen = json.loads(who.run_in_kernel(code))
            assert len(seen["gpus"]) == 1, seen
            mine = seen["gpus"][0]  # simulated GPUs: minor number = index
            want = {str(m): ("ENXIO" if m == mine else "EPERM") for m in range(4)}
            assert seen["plain"] == want, (who.name, seen)
            assert seen["unset"] == want, (who.name, seen)
    finally:
        shutil.rmtree(dev)


# -- item 10: the data folder is private --------------------------------------------------

def test_nothing_in_the_data_folder_is_readable_by_another_account(hub, vic, eve):
    data = hub.data_dir
    for name in ("jupyterhub.sqlite", "gpulab.sqlite"):
        assert stat.S_IMODE(os.stat(data / name).st_mode) == 0o600
    eve_account = eve.account
    paths = []
    for root, dirs, files in os.walk(data):
        rel = os.path.relpath(root, data)
        if rel == "shared" or rel.startswith("shared" + os.sep):
            dirs[:] = []  # the shared storage: datasets readable by design, users/ tested elsewhere
            continue
        for f in files:
            path = os.path.join(root, f)
            st = os.lstat(path)
            # eve's own server certificate (handed to her account) is hers to read
            if st.st_gid == eve_account.pw_gid or st.st_uid == eve_account.pw_uid:
                continue
            paths.append(path)
    assert len(paths) > 5, paths
    listing = "\n".join(paths)
    r = eve.sh("while IFS= read -r p; do if head -c1 \"$p\" >/dev/null 2>&1; then echo \"READ $p\"; fi; "
               f"done <<'EOF'\n{listing}\nEOF\n"
               f"ls {data} >/dev/null 2>&1 && echo LISTED; true")
    # (certipy, which JupyterHub's internal_ssl uses, makes its store folder 0755 and
    # certificates 0644 at every certificate it writes: the store lies inside <data>/tls/,
    # 0700, see gpulab.hub.deploy.local.internal_certs_dir)
    assert r.stdout.strip() == "", "readable by another account:\n" + r.stdout


# -- item 11: a private /tmp per server ---------------------------------------------------

def test_every_server_has_a_private_tmp(hub, vic, eve):
    mark = uuid.uuid4().hex
    out = vic.run_in_kernel(
        "import os\n"
        "os.makedirs('/tmp/my_working_dir', exist_ok=True)\n"
        f"open('/tmp/my_working_dir/x', 'w').write({mark!r})\n"
        "print(open('/tmp/my_working_dir/x').read())\n")
    assert out.strip() == mark
    out = eve.run_in_kernel(
        "import os\n"
        "print(os.path.exists('/tmp/my_working_dir/x'))\n"
        "os.makedirs('/tmp/my_working_dir', exist_ok=True)\n"
        "open('/tmp/my_working_dir/x', 'w').write('eve')\n"
        "print(open('/tmp/my_working_dir/x').read())\n")
    assert out.split() == ["False", "eve"], out
    # vic's file is where she left it, and nowhere on the machine's own /tmp
    assert vic.run_in_kernel("print(open('/tmp/my_working_dir/x').read())").strip() == mark
    try:
        assert open("/tmp/my_working_dir/x").read() not in (mark, "eve")
    except OSError:
        pass


def test_a_revoked_token_stops_opening_the_server_within_seconds(hub, vic):
    """vic's token leaked; vic revokes it at the hub. vic's running notebook server asks the
    hub again after 5 s (gpulab's server extension bounds its ``HubOAuth`` cache), not after
    JupyterHub's default 300 s, so the token stops opening the server (its kernels, its
    files) seconds later."""
    r = vic.api("POST", "/users/vic/tokens", json={"note": "leaked"})
    assert r.status_code == 201, r.text
    leaked, tid = r.json()["token"], r.json()["id"]
    url = hub.user_url("vic") + "api/contents"
    h = {"Authorization": f"token {leaked}"}
    assert requests.get(url, headers=h).status_code == 200  # the server caches the answer
    assert vic.api("DELETE", f"/users/vic/tokens/{tid}").status_code == 204
    t0 = time.monotonic()
    while (status := requests.get(url, headers=h, allow_redirects=False).status_code) == 200:
        assert time.monotonic() - t0 < 20, "vic's server still took a revoked token after 20 s"
        time.sleep(0.5)
    assert status in (302, 401, 403) and time.monotonic() - t0 < 8, status
    # vic's own session is untouched
    assert requests.get(url, headers={"Authorization": f"token {vic.token()}"}).status_code == 200


# -- issue 33 item 1: nobody reads another person's kernels -------------------------------

#: eve's listener: every loopback TCP port vic's account listens on (found in /proc/net/tcp,
#: rescanned as vic's kernels come and go) gets a ZeroMQ SUB socket subscribed to everything;
#: prints the ports found, how many listening sockets it saw in all, and whether `secret` came
#: through (what read vic's cells on 4f6998b)
LISTEN = r"""
import select, socket, sys, time, zmq
uid, secret, seconds = int(sys.argv[1]), sys.argv[2].encode(), float(sys.argv[3])
ctx, poller, ports, got = zmq.Context(), zmq.Poller(), set(), False

listening = 0

def scan():
    global listening
    found = set()
    for line in open("/proc/net/tcp").readlines()[1:]:
        f = line.split()
        addr, port = f[1].split(":")
        listening += f[3] == "0A"
        if f[3] == "0A" and int(f[7]) == uid:
            ip = socket.inet_ntoa(bytes.fromhex(addr)[::-1])
            found.add(("127.0.0.1" if ip == "0.0.0.0" else ip, int(port, 16)))
    return found

print("READY", flush=True)
deadline = time.time() + seconds
# until `seconds` pass, the secret is read, or a line (or EOF) on stdin says the cell is done
while time.time() < deadline and not got and not select.select([sys.stdin], [], [], 0)[0]:
    for ip, port in scan() - ports:
        ports.add((ip, port))
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{ip}:{port}")
        poller.register(s, zmq.POLLIN)
    for s, _ in poller.poll(200):
        got = got or any(secret in frame for frame in s.recv_multipart())
print("PORTS", len(ports), flush=True)
print("LISTENING", listening, flush=True)
print("SECRET", got, flush=True)
"""

#: eve connects to a Unix socket path (directly, and through the kernel's /proc/<pid>/root)
CONNECT = r"""
import json, socket, sys
out = {}
for path in json.loads(sys.argv[1]):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        out[path] = "connected"
    except OSError as e:
        out[path] = type(e).__name__
    finally:
        s.close()
print(json.dumps(out))
"""


def test_nobody_reads_another_persons_kernel(hub, vic, eve):
    """vic's kernels speak ZeroMQ over Unix sockets in her server's private runtime folder:
    eve's subscriber on every TCP port of vic's finds no kernel (on 4f6998b it read vic's
    cells: the IOPub socket is a PUB socket on 127.0.0.1), and the socket files are out of
    her reach, whichever path she tries."""
    secret = "vic-kernel-" + uuid.uuid4().hex
    acc = eve.account
    listener = subprocess.Popen(
        ["runuser", "-u", acc.pw_name, "--", sys.executable, "-c", LISTEN,
         str(vic.account.pw_uid), secret, "90"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": acc.pw_dir})
    try:
        assert listener.stdout.readline().strip() == "READY", listener.stderr.read()
        # vic's cell: its kernel lives a few seconds (eve finds its ports), then prints
        out = vic.run_in_kernel(
            "import json, os, time\n"
            "from ipykernel.connect import get_connection_info\n"
            "info = json.loads(get_connection_info())\n"
            "time.sleep(4)\n"
            f"for _ in range(15): print({secret!r}, flush=True); time.sleep(0.3)\n"
            "print(json.dumps({'info': info, 'pid': os.getpid()}))\n", timeout=90)
        # vic's cell is over: eve's scan of its whole life ends here
        stdout, stderr = listener.communicate("done\n", timeout=60)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait()
    lines = dict(line.split(" ", 1) for line in stdout.splitlines())
    # the scan worked (it saw the machine's listeners: the hub's, the relays to the servers;
    # vic's server itself listens in her own network namespace, issue 33 item 2, so none of
    # hers is in the machine's table) and read nothing
    assert int(lines["LISTENING"]) >= 1, (stdout, stderr)
    assert lines["SECRET"] == "False", "eve read vic's kernel: " + stdout
    assert out.count(secret) == 15, out  # vic's own cell ran as before
    seen = json.loads(out.strip().splitlines()[-1])
    info, kernel = seen["info"], seen["pid"]
    assert info["transport"] == "ipc", info
    assert info["ip"].startswith("/tmp/jupyter-runtime/kernel-"), info

    # the kernel is gone (run_in_kernel shut it down): a live one to aim at
    done = f".attacks-done-{uuid.uuid4().hex[:8]}"
    code = ("import json, os, time\n"
            "from ipykernel.connect import get_connection_info\n"
            "info = json.loads(get_connection_info())\n"
            "print(json.dumps({'path': f\"{info['ip']}-{info['iopub_port']}\", 'pid': os.getpid()}),"
            " flush=True)\n"
            "end = time.time() + 60\n"  # alive until the attacks are over (a file says so)
            f"while time.time() < end and not os.path.exists('/tmp/{done}'):\n"
            "    time.sleep(0.2)\n")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(vic.run_in_kernel, code, "", 90)
        deadline = time.time() + 60
        live = None
        while live is None and time.time() < deadline:
            # the kernel's socket files, found as root inside vic's server (its mount namespace)
            for pid in pids_of_uid(vic.account.pw_uid):
                try:
                    names = os.listdir(f"/proc/{pid}/root/tmp/jupyter-runtime")
                except OSError:
                    continue
                socks = [n for n in names if "-ipc-" in n]
                if socks:
                    live = (pid, sorted(socks))
                    break
            time.sleep(0.3)
        assert live is not None, "vic's kernel sockets were not found"
        pid, socks = live
        folder = f"/proc/{pid}/root/tmp/jupyter-runtime"
        st = os.stat(folder)
        # vic's alone (Jupyter adds the sticky bit against tmp cleaners)
        assert st.st_uid == vic.account.pw_uid and st.st_mode & 0o077 == 0, oct(st.st_mode)
        assert all(stat.S_ISSOCK(os.stat(f"{folder}/{n}").st_mode) for n in socks)
        targets = [f"/tmp/jupyter-runtime/{n}" for n in socks] + [f"{folder}/{n}" for n in socks]
        r = eve.sh(f"{sys.executable} -c {shlex.quote(CONNECT)} {shlex.quote(json.dumps(targets))}",
                   check=True)
        tried = json.loads(r.stdout)
        assert "connected" not in tried.values(), tried
        # and from eve's own server (its kernel: her /tmp, her /proc)
        tried = json.loads(eve.run_in_kernel(
            f"import sys\nsys.argv = ['x', {json.dumps(targets)!r}]\n" + CONNECT))
        assert "connected" not in tried.values(), tried
        with open(f"/proc/{pid}/root/tmp/{done}", "w"):
            pass  # vic's kernel may end
        first = json.loads(running.result(timeout=90).strip().splitlines()[0])
        assert first["path"].startswith("/tmp/jupyter-runtime/"), first


def pids_of_uid(uid: int) -> list[int]:
    """The pids of `uid`'s processes (as root, in the tests' own /proc: all of them)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    out.append(int(name))
            except OSError:
                pass
    return out




# -- issue 33 item 5: private IPC and /dev/shm per server ---------------------------------

def test_a_servers_shared_memory_is_its_own(hub, vic, eve):
    """vic's /dev/shm file and System V segment are neither seen nor read by eve (from her
    server or her shell), and a name vic is about to use cannot be squatted by eve."""
    name, later = (f"gpulab-{uuid.uuid4().hex[:8]}" for _ in range(2))
    secret = uuid.uuid4().hex
    # System V segments are listed (key, id, ..., uid) in /proc/sysvipc/shm, per namespace
    segments = ("[dict(zip(('key', 'id', 'uid'), (l.split()[0], l.split()[1], l.split()[7])))"
                " for l in open('/proc/sysvipc/shm').readlines()[1:]]")
    out = vic.run_in_kernel(
        "import json, os, subprocess\n"
        f"open('/dev/shm/{name}', 'w').write({secret!r})\n"
        "made = subprocess.run(['ipcmk', '-M', '4096'], capture_output=True, text=True,"
        " check=True).stdout\n"
        "st = os.statvfs('/dev/shm')\n"
        "print(json.dumps({'shmid': made.split()[-1], 'size': st.f_blocks * st.f_frsize,\n"
        f"                  'segments': {segments}}}))\n")
    made = json.loads(out)
    vic_uid = str(vic.account.pw_uid)
    mine = [seg for seg in made["segments"] if seg["id"] == made["shmid"]]
    assert len(mine) == 1 and mine[0]["uid"] == vic_uid, made  # vic sees her own segment
    key = mine[0]["key"]
    # a sensible size: not Docker's 64 MB (data loaders need more), at most the RAM
    assert 64 * 2**20 < made["size"] <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    seen = json.loads(eve.run_in_kernel(
        "import json, os\n"
        "shm = os.listdir('/dev/shm')\n"
        f"try:\n    got = open('/dev/shm/{name}').read()\nexcept OSError as e:\n"
        "    got = type(e).__name__\n"
        f"open('/dev/shm/{later}', 'w').close(); os.chmod('/dev/shm/{later}', 0o666)\n"
        f"print(json.dumps({{'shm': shm, 'got': got, 'segments': {segments}}}))\n"))
    assert name not in seen["shm"] and seen["got"] == "FileNotFoundError", seen
    assert all(seg["key"] != key and seg["uid"] != vic_uid for seg in seen["segments"]), seen
    r = eve.sh(f"ls /dev/shm; cat /dev/shm/{name}; cat /proc/sysvipc/shm")
    assert secret not in r.stdout and name not in r.stdout, r.stdout
    rows = [f for f in map(str.split, r.stdout.splitlines())
            if len(f) > 7 and f[0].lstrip("-").isdigit()]  # the machine's segments
    assert all(f[0] != key and f[7] != vic_uid for f in rows), r.stdout
    assert not os.path.exists(f"/dev/shm/{name}") and not os.path.exists(f"/dev/shm/{later}")

    # vic makes the name eve made in her own /dev/shm: hers, not eve's
    out = vic.run_in_kernel(
        "from multiprocessing import shared_memory\n"
        f"m = shared_memory.SharedMemory({later!r}, create=True, size=64)\n"
        "m.buf[:2] = b'ok'; print(bytes(m.buf[:2]).decode()); m.close(); m.unlink()\n"
        f"print(open('/dev/shm/{name}').read())\n"
        f"import subprocess; subprocess.run(['ipcrm', '-m', {made['shmid']!r}], check=True)\n")
    assert out.split() == ["ok", secret], out


# -- issue 33 item 8: a server sees only its own account's processes ----------------------

def test_a_server_sees_only_its_own_processes(hub, vic, eve):
    mark = "vic-mark-" + uuid.uuid4().hex[:8]
    list_procs = (
        "import json, os, psutil\n"
        "cmd = {}\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit():\n"
        "        try:\n"
        "            cmd[p] = open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace')\n"
        "        except OSError:\n"
        "            pass\n"
        "print(json.dumps({'me': os.getpid(), 'cmd': cmd,"
        " 'psutil': [p.pid for p in psutil.process_iter()]}))\n")
    out = vic.run_in_kernel(
        "import subprocess\n"
        f"p = subprocess.Popen(['bash', '-c', 'exec -a {mark} sleep 300'],"
        " start_new_session=True)\n"  # it outlives the kernel
        "print(p.pid)\n")
    sleeper = int(out.strip())
    try:
        mine = json.loads(vic.run_in_kernel(list_procs))
        assert mark in " ".join(mine["cmd"].values()), mine  # vic sees her own
        assert str(mine["me"]) in mine["cmd"] and mine["me"] in mine["psutil"]
        assert "1" not in mine["cmd"], "the machine's init (root's) is listed"
        # TensorFlow (it reads /proc for CPUs and memory) and a multiprocessing data pipeline
        # through /dev/shm still work in the sandbox
        out = vic.run_in_kernel(
            "import os; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\n"
            "import multiprocessing as mp, tensorflow as tf\n"
            "print('TF', int(tf.reduce_sum(tf.range(10)).numpy()))\n"
            "with mp.get_context('spawn').Pool(2) as pool:\n"
            "    print('POOL', sum(pool.map(abs, [-1, -2])))\n", timeout=180)
        assert "TF 45\n" in out and "POOL 3\n" in out, out
        theirs = json.loads(eve.run_in_kernel(list_procs + (
            f"import os\nprint(os.path.exists('/proc/{sleeper}'))\n")).splitlines()[0])
        assert str(theirs["me"]) in theirs["cmd"] and theirs["me"] in theirs["psutil"]
        assert str(sleeper) not in theirs["cmd"] and sleeper not in theirs["psutil"], theirs
        assert mark not in json.dumps(theirs), theirs
        vic_uid = vic.account.pw_uid
        assert not set(theirs["cmd"]) & {str(p) for p in pids_of_uid(vic_uid)}
        # a terminal of eve's runs in the same sandbox: `ps` there lists her account only
        out = run_in_terminal(eve, "ps -e -o user= | sort -u; echo $JUPYTER_RUNTIME_DIR")
        assert out.split() == [eve.account.pw_name, "/tmp/jupyter-runtime"], out
    finally:
        if pid_exists(sleeper):
            os.kill(sleeper, 9)


def run_in_terminal(b: Browser, command: str, timeout: float = 30) -> str:
    """Run `command` in a new JupyterLab terminal of `b`'s server (its REST and websocket
    API, as JupyterLab does); what it printed between two marks."""
    import websocket

    base = f"{b.hub.user_url(b.name)}"
    h = {"Authorization": f"token {b.token()}"}
    r = requests.post(base + "api/terminals", headers=h)
    assert r.status_code == 200, (r.status_code, r.text)
    name = r.json()["name"]
    ws = websocket.create_connection(base.replace("http", "ws", 1) + f"terminals/websocket/{name}",
                                     header=[f"Authorization: token {b.token()}"],
                                     timeout=timeout)
    mark = uuid.uuid4().hex[:8]
    try:
        ws.send(json.dumps(["stdin", f"echo BEGIN{mark}; {command}; echo END{mark}\r"]))
        text, deadline = "", time.time() + timeout
        while f"\nEND{mark}" not in text.replace("\r", "") and time.time() < deadline:
            msg = json.loads(ws.recv())
            if msg[0] == "stdout":
                text += msg[1]
        # without the shell's escapes (bracketed paste, the window title, colours)
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07", "", text.replace("\r", ""))
        assert f"BEGIN{mark}\n" in text and f"\nEND{mark}" in text, text
        return text.split(f"BEGIN{mark}\n", 1)[1].split(f"\nEND{mark}", 1)[0]
    finally:
        ws.close()
        requests.delete(base + f"api/terminals/{name}", headers=h)

