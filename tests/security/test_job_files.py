"""Attacks through the files of a job's program (``files`` beside ``source``, issue 14 item 8),
made by eve against vic and the machine, through the HTTP API of a real `gpulab up` as root.

The service writes a job's code files as root into eve's own folder (``jobs/<job>/code/``),
by names eve chooses and under folders eve controls. She tries to make it write elsewhere:
names that climb out (``..``, absolute paths, look-alike Unicode, NUL), and links planted in
place of the code folder or of a file, to vic's folder, to ``/etc``, also swapped while she
submits. Each attempt is refused (400 naming ``files`` for a name, 409 for a planted link)
with nothing made or held, and vic's folder and ``/etc`` stay as they were.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.security

MAIN = "import helper\nprint('ran', helper.X, flush=True)\n"


def job(name, files, source=MAIN, **extra):
    return {"name": name, "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
            "source": source, "files": files, **extra}


def snapshot(folder: Path) -> dict[str, tuple[int, float, bytes]]:
    """Every entry below `folder`: size, modification time and (files) content; not hidden
    ones (vic's own server keeps its runtime files there; a code file's name is never
    hidden, so that is not where an attack would land)."""
    out = {}
    for p in sorted([folder, *folder.rglob("*")]):
        if any(part.startswith(".") for part in p.relative_to(folder).parts):
            continue
        st = p.lstat()
        data = p.read_bytes() if p.is_file() and not p.is_symlink() else b""
        out[str(p)] = (st.st_size, st.st_mtime, data)
    return out


@pytest.fixture(scope="module")
def places(hub, vic, eve):
    """(eve's folder, vic's folder with a file of his, what must stay untouched)."""
    users = hub.data_dir / "shared" / "users"
    vic_dir = users / "vic"
    vic.sh(f"mkdir -p {vic_dir} && echo 'X = \"vic-secret\"' > {vic_dir}/helper.py", check=True)
    eve_dir = users / "eve"
    eve.sh(f"mkdir -p {eve_dir}/jobs", check=True)
    return eve_dir, vic_dir


PAYLOAD = "X = 'eve'"


def untouched(vic_dir: Path):
    """vic's folder as it is, and whether eve's payload reached /etc (whose files other
    tests on this machine change meanwhile: accounts come and go)."""
    etc = [Path("/etc/passwd"), Path("/etc/shadow"), Path("/etc/source.py"),
           Path("/etc/helper.py"), Path("/etc/cron.d/x")]
    return {**snapshot(vic_dir),
            "payload in /etc": [str(p) for p in etc if p.exists() and PAYLOAD in p.read_text()]}


def nothing_made(eve, eve_dir: Path, name: str):
    assert eve.service("GET", f"jobs/{name}").status_code == 404
    held = [h for h in eve.service("GET", "me").json()["holdings"] if h["kind"] == "job"]
    assert held == [], held


NAMES = ["../../vic/helper.py", "../helper.py", "..", "/etc/cron.d/x",
         "code/../../x.py", "a/b.py", ".bashrc", "..\\x.py",
         "\u2024\u2024\u2215x.py",  # one-dot leaders and a division slash: "../x.py" look-alike
         "\uff0e\uff0e\uff0fhelper.py",  # fullwidth "../"
         "helper\u202eyp.py",  # right-to-left override
         "helper.py\u200b",  # zero-width space
         "x" * 101, "source.py", "__pycache__", "helper.py\n"]


@pytest.mark.parametrize("name", NAMES, ids=[repr(n)[:24] for n in NAMES])
def test_a_file_name_cannot_leave_the_code_folder(eve, places, name):
    eve_dir, vic_dir = places
    before = untouched(vic_dir)
    r = eve.service("POST", "jobs", json=job("names", {name: PAYLOAD + "\n"}))
    assert r.status_code == 400 and r.json()["field"] == "files", r.text
    nothing_made(eve, eve_dir, "names")
    assert not (eve_dir / "jobs" / "names").exists()
    assert untouched(vic_dir) == before


@pytest.mark.parametrize("body", [
    b'{"name": "raw1", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1}, '
    b'"source": "x", "files": {"a\\u0000/../../x.py": "x"}}',
    b'{"name": "raw2", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1}, '
    b'"source": "x", "files": {"\\ud800.py": "x"}}',
    b'{"name": "raw3", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1}, '
    b'"source": "x", "files": {"a.py": "x\\u0000"}}',
    b'{"name": "raw4", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1}, '
    b'"script": "x.py", "files": {"a.py": "x"}}',
], ids=["nul-in-name", "surrogate-name", "nul-in-text", "files-with-script"])
def test_raw_bodies_no_name_may_hold_are_refused(eve, places, body):
    eve_dir, vic_dir = places
    r = eve.service("POST", "jobs", data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["field"].startswith("files"), r.text
    name = json.loads(body.decode("utf-8", "surrogatepass").replace("\\u0000", ""))["name"]
    nothing_made(eve, eve_dir, name)


PLANTS = {
    # the code folder is a link: to vic's folder, to /etc
    "code-to-vic": "mkdir -p {job} && ln -s {vic} {job}/code",
    "code-to-etc": "mkdir -p {job} && ln -s /etc {job}/code",
    # the job folder itself is a link to vic's folder
    "job-to-vic": "ln -s {vic} {job}",
    # a file of the program is a link to vic's file of the same name, or to /etc/passwd
    "file-to-vic": "mkdir -p {job}/code && ln -s {vic}/helper.py {job}/code/helper.py",
    "file-to-passwd": "mkdir -p {job}/code && ln -s /etc/passwd {job}/code/helper.py",
    # a hard link (to a file of her own: the kernel lets nobody link someone else's)
    "file-hardlink": "mkdir -p {job}/code && echo mine > {job}/own && "
                     "ln {job}/own {job}/code/helper.py",
    # a FIFO in place of the file (a write would wait forever)
    "file-fifo": "mkdir -p {job}/code && mkfifo {job}/code/helper.py",
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_link_is_never_followed(eve, places, plant):
    eve_dir, vic_dir = places
    name = f"planted-{plant}"
    folder = eve_dir / "jobs" / name
    eve.sh(PLANTS[plant].format(job=folder, vic=vic_dir), check=True)
    before = untouched(vic_dir)
    t0 = time.monotonic()
    r = eve.service("POST", "jobs", json=job(name, {"helper.py": PAYLOAD + "\n"}), timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.status_code == 409 and r.json()["field"] == "name", r.text
    assert "link" in r.json()["message"] or "not a folder or plain file" in r.json()["message"]
    nothing_made(eve, eve_dir, name)
    assert untouched(vic_dir) == before
    assert not (vic_dir / "source.py").exists() and not Path("/etc/source.py").exists()
    assert not Path("/etc/helper.py").exists()
    if plant == "file-hardlink":  # refused before the file was emptied
        assert (folder / "own").read_text() == "mine\n"


SWAPPER = """
import os, sys, time
jobs, vic, names, seconds = sys.argv[1], sys.argv[2], sys.argv[3].split(","), float(sys.argv[4])
for n in names:
    os.makedirs(f"{jobs}/{n}/code", exist_ok=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for n in names:
        code = f"{jobs}/{n}/code"
        try:  # the folder out, a link to vic's folder in, and back
            os.rename(code, code + ".d")
            os.symlink(vic, code)
            os.unlink(code)
            os.rename(code + ".d", code)
        except OSError:
            pass
"""


def test_swapping_the_code_folder_while_submitting_never_writes_elsewhere(eve, places):
    """The code folder swapped for a link to vic's folder and back, thousands of times a
    second, while eve submits: each submit runs in a real folder of hers or is refused
    (safefs walks every component without following links: no check-then-use window), and
    nothing reaches vic's folder."""
    eve_dir, vic_dir = places
    names = [f"race-{i}" for i in range(6)]
    before = untouched(vic_dir)
    swapper = eve_dir / "swapper.py"
    eve.sh(f"cat > {swapper} <<'EOF'\n{SWAPPER}\nEOF", check=True)
    eve.sh(f"python3 {swapper} {eve_dir}/jobs {vic_dir} {','.join(names)} 15 "
           ">/dev/null 2>&1 &", check=True)
    t0 = time.monotonic()
    answers = []
    for n in names:
        time.sleep(0.5)
        r = eve.service("POST", "jobs", json=job(n, {"helper.py": PAYLOAD + "\n"},
                                                    max_runtime=120), timeout=60)
        assert r.status_code in (201, 409), r.text
        answers.append(r.status_code)
    time.sleep(max(0.0, 16 - (time.monotonic() - t0)))  # the swapper has ended
    print("race answers:", answers)
    assert untouched(vic_dir) == before
    assert not (vic_dir / "source.py").exists() and not (vic_dir / "code").exists()
    for n, code in zip(names, answers):
        if code == 201:
            assert eve.service("POST", f"jobs/{n}/stop").status_code == 200
    for n, code in zip(names, answers):
        if code != 201:
            nothing_made(eve, eve_dir, n)


MOVER = """
import os, sys, time
jobs, vic, name = sys.argv[1], sys.argv[2], sys.argv[3]
folder = f"{jobs}/{name}"
log = f"{folder}/logs/worker-0.log"
end = time.monotonic() + 60
while not os.path.exists(log) and time.monotonic() < end:
    pass  # the service opens the replica's log just before it starts the replica
os.rename(folder, folder + ".moved")  # the job folder out, a link to vic's folder in
os.symlink(vic, folder)
print("moved", flush=True)
"""


def test_moving_the_job_folder_as_the_replica_starts_is_a_409(eve, places):
    """Issue 33 item 8: eve waits for the service to open her replica's log, then swaps
    the job folder for a link to vic's folder while the replica is being started (its
    ``preexec`` enters the folder as eve, without following links). Before, that failure
    came back as "could not be started" (500); now it is her folder that changed: 409, no
    job, nothing held, and nothing reaches vic's folder."""
    eve_dir, vic_dir = places
    mover = eve_dir / "mover.py"
    eve.sh(f"cat > {mover} <<'EOF'\n{MOVER}\nEOF", check=True)
    before = untouched(vic_dir)
    for n in ("moved-0", "moved-1"):
        out = eve_dir / f"{n}.out"
        eve.sh(f"python3 {mover} {eve_dir}/jobs {vic_dir} {n} >{out} 2>&1 &", check=True)
        time.sleep(0.5)
        r = eve.service("POST", "jobs", json=job(n, {"helper.py": PAYLOAD + "\n"}), timeout=60)
        deadline = time.monotonic() + 10
        while "moved" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "moved" in out.read_text(), out.read_text()
        print("answer", n, r.status_code, r.text[:300])
        if r.status_code == 201:  # the replica was in its folder before the swap: it runs
            assert eve.service("POST", f"jobs/{n}/stop").status_code == 200
            continue
        assert r.status_code == 409 and r.json()["field"] == "name", r.text
        assert "moved" in r.json()["message"], r.text
        nothing_made(eve, eve_dir, n)
    assert untouched(vic_dir) == before
    assert not (vic_dir / "source.py").exists() and not (vic_dir / "logs").exists()
