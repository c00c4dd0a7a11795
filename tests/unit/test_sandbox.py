"""hub/machine/sandbox.py and the replica environment: namespaces, private /tmp, the working
directory entered as the person, and what a replica's environment may hold.

The namespace tests need root (they make real namespaces, in forked children); without root
they are skipped with that reason (the security tier, tests/security, fails instead).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from gpulab.hub.jobs.local import replica_env
from gpulab.hub.jobs.spec import JobSpec
from gpulab.hub.machine import sandbox

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root")
NOBODY = (65534, 65534)


def in_child(fn) -> tuple[int, str]:
    """Run `fn` in a forked child; (its exit code, what it wrote to the pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        code = 0
        try:
            out = fn()
            os.write(w, json.dumps(out).encode())
        except BaseException as e:  # noqa: BLE001
            os.write(w, json.dumps(f"{type(e).__name__}: {e}").encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), json.loads(text)


SPEC = JobSpec.model_validate({"name": "j", "strategy": "multi-worker-mirrored",
                               "replicas": {"worker": 2}, "source": "print(1)",
                               "env": {"LEARNING_RATE": "0.1"}})


def test_replica_environment_is_built_from_an_allow_list():
    service = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC",
               "JUPYTERHUB_API_TOKEN": "hub-secret", "JPY_API_TOKEN": "hub-secret",
               "GPULAB_LEDGER_URL": "sqlite:////data/ledger.sqlite", "PYTHONPATH": "/evil",
               "LD_PRELOAD": "/evil.so", "TF_CONFIG": "stale", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
               "HOME": "/root", "USER": "root", "SSL_KEYFILE": "/data/key.pem"}
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    env = replica_env(service, spec=SPEC, job_name="j", job_dir="/d/u/jobs/j",
                      user_dir="/d/u", role="worker", index=1, cluster=cluster, devices=[2],
                      account=("jupyter-u", "/home/jupyter-u"))
    assert env == {
        "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "TZ": "UTC",
        "LEARNING_RATE": "0.1",
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}}),
        "GPULAB_STRATEGY": "multi-worker-mirrored", "GPULAB_KIND": "job", "GPULAB_JOB_NAME": "j",
        "GPULAB_JOB_DIR": "/d/u/jobs/j", "GPULAB_USER_DIR": "/d/u",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2",
        "NVIDIA_VISIBLE_DEVICES": "2", "PYTHONUNBUFFERED": "1",
        "USER": "jupyter-u", "LOGNAME": "jupyter-u", "HOME": "/home/jupyter-u",
    }
    # no GPUs: none visible; no PATH in the service: a plain one
    env = replica_env({}, spec=SPEC, job_name="j", job_dir="/j", user_dir="/u", role="worker",
                      index=0, cluster=cluster, devices=[])
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin" and "USER" not in env
    assert "TF_ENABLED_DEVICE_TYPES" not in env  # real GPUs (the default): TensorFlow's own


def test_replica_on_simulated_gpus_keeps_its_gpus_and_tells_tensorflow_there_is_no_cuda():
    """Simulated GPUs: CUDA_VISIBLE_DEVICES still names the replica's share, and TensorFlow is
    told to use the CPU, so that it calls no cuInit of a driver that is not installed (and
    logs no "failed call to cuInit ... (303)"); a spec that sets it itself is obeyed."""
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    kw = dict(spec=SPEC, job_name="j", job_dir="/j", user_dir="/u", role="worker", index=1,
              cluster=cluster, cuda=False)
    env = replica_env({}, devices=[2, 3], **kw)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["NVIDIA_VISIBLE_DEVICES"] == "2,3"
    assert env["TF_ENABLED_DEVICE_TYPES"] == "CPU"
    assert replica_env({}, devices=[], **kw)["TF_ENABLED_DEVICE_TYPES"] == "CPU"  # a ps
    own = JobSpec.model_validate({**SPEC.model_dump(),
                                  "env": {"TF_ENABLED_DEVICE_TYPES": "CPU,GPU"}})
    assert replica_env({}, devices=[2], **{**kw, "spec": own})["TF_ENABLED_DEVICE_TYPES"] \
        == "CPU,GPU"


@root_only
def test_private_dir_is_the_persons_below_roots_closed_folder(tmp_path):
    parent = tmp_path / "tmp-root"
    d = sandbox.make_private_dir(parent, "job1", NOBODY)
    assert stat.S_IMODE(os.stat(parent).st_mode) == 0o700 and os.stat(parent).st_uid == 0
    st = os.stat(d)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*NOBODY, 0o700)
    # a link in its place is refused, never followed
    os.rmdir(d)
    (parent / "job1").symlink_to(tmp_path)
    with pytest.raises(sandbox.SandboxError):
        sandbox.make_private_dir(parent, "job1", NOBODY)
    assert os.stat(tmp_path).st_uid == 0
    (parent / "job1").unlink()
    # a parent that is a link is refused too
    (tmp_path / "linked").symlink_to(parent)
    with pytest.raises(sandbox.SandboxError):
        sandbox.make_private_dir(tmp_path / "linked", "job2", NOBODY)
    sandbox.remove_private_dir(parent, "job1")
    sandbox.remove_private_dir(parent, "missing")  # harmless


@root_only
def test_private_tmp_hides_the_machines_tmp_and_keeps_named_folders(tmp_path):
    parent = tmp_path / "tmp-root"
    private = sandbox.make_private_dir(parent, "job1", NOBODY)
    mine = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpulab-sandbox-{os.getpid()}"
    # a tutorial's folder name, made unique: the machine's own /tmp may hold the plain one
    named = f"my_working_dir-{os.getpid()}"
    (mine / "users" / "u").mkdir(parents=True)
    (mine / "users" / "u" / "data.txt").write_text("kept")
    os.chmod(mine, 0o711)
    os.chmod(mine / "users", 0o711)
    os.chown(mine / "users" / "u", *NOBODY)
    try:
        def child():
            sandbox.private_tmp(private, keep=[mine / "users" / "u"])
            os.setgid(NOBODY[1])
            os.setuid(NOBODY[0])
            sandbox.enter_dir(mine / "users" / "u")
            os.makedirs(f"/tmp/{named}")
            Path(f"/tmp/{named}/ckpt").write_text("x")
            return {"cwd": os.getcwd(), "kept": Path("data.txt").read_text(),
                    "tmp": sorted(os.listdir("/tmp"))}

        code, out = in_child(child)
        assert code == 0, out
        assert out["kept"] == "kept" and out["cwd"] == str(mine / "users" / "u")
        assert named in out["tmp"]
        # what the child wrote is in its private folder, not in the machine's /tmp
        assert (private / named / "ckpt").read_text() == "x"
        assert not Path(f"/tmp/{named}/ckpt").exists()
        assert os.listdir(mine / "users" / "u") == ["data.txt"]
    finally:
        sandbox.remove_private_dir(mine.parent, mine.name)


@pytest.fixture
def passable():
    """A folder other accounts can pass through (pytest's tmp_path lies in a 0700 one)."""
    d = Path(tempfile.mkdtemp(prefix="gpulab-sandbox-"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@root_only
def test_enter_dir_never_follows_a_link_and_runs_with_the_persons_rights(passable):
    tmp_path = passable
    closed = tmp_path / "closed"  # root's, 0700: nobody may enter
    closed.mkdir(mode=0o700)
    home = tmp_path / "home"
    (home / "jobs").mkdir(parents=True)
    os.chown(home, *NOBODY)
    os.chown(home / "jobs", *NOBODY)
    (home / "jobs" / "j").symlink_to(closed)

    def as_nobody():
        os.setgid(NOBODY[1])
        os.setuid(NOBODY[0])
        sandbox.enter_dir(home, ["jobs", "j"])
        return os.getcwd()

    code, out = in_child(as_nobody)
    assert code == 1 and "link" in out, out
    # even as root (no privileges dropped) a link on the way is refused
    code, out = in_child(lambda: sandbox.enter_dir(home, ["jobs", "j"]))
    assert code == 1 and "link" in out, out


@root_only
def test_a_job_network_holds_only_loopback(tmp_path):
    base = tmp_path / "netns"
    path = sandbox.make_netns("job1", base)
    assert sandbox.netns_names(base) == ["job1"]
    host_net = os.stat("/proc/self/ns/net").st_ino
    assert os.stat(path).st_ino != host_net  # a namespace of its own, kept by the mount
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    host_port = listener.getsockname()[1]
    fd = sandbox.open_netns("job1", base)
    try:
        def child():
            sandbox.join_netns(fd)
            links = subprocess.run(["/usr/sbin/ip", "-o", "link"], capture_output=True,
                                   text=True).stdout
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            socket.create_connection(s.getsockname(), timeout=2).close()
            try:  # the machine's loopback service is not reachable from inside
                socket.create_connection(("127.0.0.1", host_port), timeout=2).close()
                host = "reached"
            except OSError:
                host = "unreachable"
            return {"links": [x.split(":")[1].strip() for x in links.splitlines()],
                    "up": "UP" in links, "host": host}

        code, out = in_child(child)
    finally:
        os.close(fd)
        listener.close()
    assert code == 0, out
    assert out == {"links": ["lo"], "up": True, "host": "unreachable"}
    assert os.stat("/proc/self/ns/net").st_ino == host_net  # this process stayed put
    sandbox.remove_netns("job1", base)
    assert not path.exists() and sandbox.netns_names(base) == []
    sandbox.remove_netns("job1", base)  # harmless


# -- private IPC, /dev/shm and /proc (issue 33 items 5 and 8) -----------------------------

@pytest.mark.parametrize("size, options", [
    (None, "mode=1777"),  # the kernel's default for tmpfs: half the RAM
    (0, "mode=1777"),
    (8 * 2**30, f"mode=1777,size={8 * 2**30}"),
], ids=["default", "zero", "8Gi"])
def test_shm_options(size, options):
    assert sandbox.shm_options(size) == options


def test_shm_options_refuse_a_negative_size():
    with pytest.raises(ValueError, match="number of bytes"):
        sandbox.shm_options(-1)


def _mount_of(target: str) -> tuple[str, str, set[str]]:
    """(fstype, super options, mount options) of the last mount on `target` (mountinfo)."""
    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        left, right = line.split(" - ")
        fields = left.split()
        if fields[4] == target:
            fstype, _, sopts = right.split()
            return fstype, sopts, set(fields[5].split(","))
    raise AssertionError(f"nothing mounted on {target}")


@root_only
def test_private_ipc_shm_and_proc(tmp_path):
    """The child's /dev/shm is a fresh tmpfs of the size asked, its IPC namespace its own,
    its /proc shows only its own account's processes; /tmp stays the machine's (no folder)."""
    parent_ipc = os.readlink("/proc/self/ns/ipc")
    parent = os.getpid()

    def child():
        sandbox.private_tmp(None, ipc=True, shm_size=32 * 2**20, hide_pids=True)
        shm, proc = _mount_of("/dev/shm"), _mount_of("/proc")
        os.setgid(NOBODY[1])
        os.setuid(NOBODY[0])
        st = os.statvfs("/dev/shm")
        mode = stat.S_IMODE(os.stat("/dev/shm").st_mode)
        Path("/dev/shm/mine").write_text("x")  # world-writable, as /dev/shm is everywhere
        return {"ipc": os.readlink("/proc/self/ns/ipc"), "shm": os.listdir("/dev/shm"),
                "size": st.f_blocks * st.f_frsize, "shm_mount": [shm[0], shm[1], sorted(shm[2])],
                "proc_mount": [proc[0], proc[1], sorted(proc[2])],
                "pids": [p for p in os.listdir("/proc") if p.isdigit()], "me": os.getpid(),
                "tmp_same": os.stat("/tmp").st_ino, "mode": mode}

    code, out = in_child(child)
    assert code == 0, out
    assert out["ipc"] != parent_ipc
    assert out["shm"] == ["mine"] and out["size"] == 32 * 2**20
    assert out["shm_mount"][0] == "tmpfs" and out["mode"] == 0o1777
    assert {"nosuid", "nodev"} <= set(out["shm_mount"][2])
    assert out["proc_mount"][0] == "proc" and "hidepid=invisible" in out["proc_mount"][1]
    assert {"nosuid", "nodev", "noexec"} <= set(out["proc_mount"][2])
    assert str(out["me"]) in out["pids"] and str(parent) not in out["pids"]
    assert out["tmp_same"] == os.stat("/tmp").st_ino
    assert not Path("/dev/shm/mine").exists()  # nothing reached the machine's /dev/shm


def _spawner(**traits):
    from types import SimpleNamespace

    from traitlets.config import Config

    from gpulab.spawner.local import LocalGPUSpawner

    c = Config()
    for name, value in traits.items():
        setattr(c.LocalGPUSpawner, name, value)
    return LocalGPUSpawner(config=c, user=SimpleNamespace(name="ann", id=1, groups=[],
                                                          url="/user/ann/"))


def test_isolated_servers_run_kernels_over_unix_sockets_in_their_private_tmp():
    s = _spawner(isolate_users=True, private_tmp=True)
    assert "--KernelManager.transport=ipc" in s.get_args()
    assert s.kernel_env() == {"JUPYTER_RUNTIME_DIR": "/tmp/jupyter-runtime"}
    # without a private /tmp: sockets in the Jupyter runtime folder of the account's home
    s = _spawner(isolate_users=True, private_tmp=False)
    assert "--KernelManager.transport=ipc" in s.get_args()
    assert s.kernel_env() == {}
    # not isolated (one account runs every server): TCP, as Jupyter's default
    s = _spawner(isolate_users=False, private_tmp=False)
    assert not any("transport" in a for a in s.get_args())


@pytest.mark.parametrize("shm_size, mem_limit, size", [
    ("", None, "default"),  # the server's default memory limit (issue 36)
    ("", 0, None),  # no memory limit at all: the kernel's default, half the RAM
    ("", "4G", 4 * 2**30),  # the server's memory limit (JupyterHub's G is 2**30)
    ("512Mi", "4G", 512 * 2**20),  # the operator's setting wins
], ids=["default", "unlimited", "memory-limit", "set"])
def test_shm_size_of_a_server(shm_size, mem_limit, size):
    s = _spawner(shm_size=shm_size)
    if mem_limit is not None:
        s.mem_limit = mem_limit
    if size == "default":
        size = s.mem_limit
        assert size and size == s.default_mem_limit
    assert s.shm_bytes() == size


def test_a_bad_shm_size_is_refused_with_the_reason():
    from traitlets import TraitError

    with pytest.raises(TraitError, match="shm_size.*512Mi"):
        _spawner(shm_size="lots")
