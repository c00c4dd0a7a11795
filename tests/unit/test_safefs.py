"""hub/machine/safefs.py: files in a user's folder, as the privileged service opens them.

A user owns their folder and may plant anything there in place of a log: a link, a FIFO, a
socket, a huge sparse file. Each must cost only a refusal (or a bounded read), at once.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from gpulab.hub.machine import safefs


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "jobs" / "j" / "logs").mkdir(parents=True)
    return tmp_path


LOG = ["jobs", "j", "logs", "worker-0.log"]


def test_plain_file_reads_from_offset(folder):
    (folder / "jobs/j/logs/worker-0.log").write_bytes(b"hello world")
    assert safefs.read_bytes(folder, LOG, 6, 100) == (b"world", 11)
    assert safefs.read_tail(folder, LOG, 5) == b"world"


def test_missing_file_is_empty(folder):
    assert safefs.read_bytes(folder, LOG) == (b"", 0)


def test_fifo_is_refused_at_once(folder):
    os.mkfifo(folder / "jobs/j/logs/worker-0.log")
    t0 = time.monotonic()
    with pytest.raises(safefs.UnsafePath, match="not a plain file"):
        safefs.read_bytes(folder, LOG)
    with pytest.raises(safefs.UnsafePath):
        safefs.read_tail(folder, LOG, 100)
    with pytest.raises(safefs.UnsafePath):  # as the replica's log: opened for writing
        safefs.open_file(folder, LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    assert time.monotonic() - t0 < 2


def test_socket_is_refused(folder):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(folder / "jobs/j/logs/worker-0.log"))
        s.listen()
        with pytest.raises(safefs.UnsafePath):
            safefs.read_bytes(folder, LOG)
    finally:
        s.close()


def test_link_anywhere_on_the_way_is_refused(folder, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("victim")
    (elsewhere / "secret").write_text("victim's")
    os.symlink(elsewhere / "secret", folder / "jobs/j/logs/worker-0.log")
    with pytest.raises(safefs.UnsafePath, match="link"):
        safefs.read_bytes(folder, LOG)
    os.rename(folder / "jobs/j/logs", folder / "jobs/j/old")
    os.symlink(elsewhere, folder / "jobs/j/logs")
    with pytest.raises(safefs.UnsafePath):
        safefs.read_bytes(folder, ["jobs", "j", "logs", "secret"])


def test_hard_link_is_refused(folder, tmp_path_factory):
    other = tmp_path_factory.mktemp("victim") / "secret"
    other.write_text("victim's")
    os.link(other, folder / "jobs/j/logs/worker-0.log")
    with pytest.raises(safefs.UnsafePath):
        safefs.read_bytes(folder, LOG)


def test_huge_sparse_file_costs_a_bounded_read(folder):
    path = folder / "jobs/j/logs/worker-0.log"
    with open(path, "wb") as f:
        f.truncate(10 * 2**30)  # 10 GiB, sparse
    data, size = safefs.read_bytes(folder, LOG, 0, 4096)
    assert (len(data), size) == (4096, 10 * 2**30)
    assert len(safefs.read_tail(folder, LOG, 1024)) == 1024


def test_opened_writer_is_blocking_again(folder):
    import fcntl

    fd = safefs.open_file(folder, LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad", ["..", "", ".", "a\0b"])
def test_bad_components_are_refused(folder, bad):
    with pytest.raises(safefs.UnsafePath):
        safefs.read_bytes(folder, ["jobs", bad, "x"])


def test_writing_over_a_hard_link_leaves_the_other_name_whole(folder, tmp_path_factory):
    """The check comes before the file is emptied: a planted hard link to someone else's
    file (where the kernel allows one) is refused with that file intact."""
    other = tmp_path_factory.mktemp("other") / "theirs.txt"
    other.write_text("their data\n")
    os.link(other, folder / "jobs/j/source.py")
    with pytest.raises(safefs.UnsafePath, match="not a plain file"):
        safefs.write_text(folder, ["jobs", "j", "source.py"], "print('mine')\n")
    assert other.read_text() == "their data\n"
    (folder / "jobs/j/source.py").unlink()
    (folder / "jobs/j/source.py").write_text("a much longer old text\n")
    safefs.write_text(folder, ["jobs", "j", "source.py"], "new\n")  # rewritten whole
    assert (folder / "jobs/j/source.py").read_text() == "new\n"
