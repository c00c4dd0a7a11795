"""`gpulab up` refuses bad input with a message and exit code 2, starting nothing."""

import subprocess

import pytest

from .hubctl import GPULAB


def up(*args):
    return subprocess.run([GPULAB, "up", *args], capture_output=True, text=True, timeout=60)


def test_data_folder_that_cannot_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = up("--data-dir", str(blocker / "data"), "--port", "18999")
    assert r.returncode == 2
    assert "Cannot create the data folder" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "0"], "--port must be a port number"),
        (["--port", "9000", "--hub-port", "9000"], "four different ports"),
        (["--idle-timeout", "-5"], "--idle-timeout"),
        (["--simulated-gpus", "-1"], "--simulated-gpus"),
    ],
    ids=["port-zero", "same-ports", "negative-timeout", "negative-gpus"],
)
def test_bad_flags(tmp_path, args, message):
    r = up("--data-dir", str(tmp_path / "d"), *args)
    assert r.returncode == 2 and message in r.stderr
    assert not (tmp_path / "d").exists()  # nothing made
