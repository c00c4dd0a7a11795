"""The %tensorboard magic's folder of sockets goes when its server's process ends: every
server start makes a new one, and before, each stayed behind in /tmp for ever."""

import os
import signal
import subprocess
import sys
import time

CHILD = """
import signal, sys, time
from gpulab.extensions import tbmagic
folder = tbmagic.make_magic_dir()
tbmagic.write_launcher(folder)
# as jupyter_server does: SIGTERM stops the loop and the process ends normally
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
print(folder, flush=True)
time.sleep(60)
"""


def test_the_magic_folder_is_removed_when_the_server_process_ends():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    folder = p.stdout.readline().strip()
    assert os.path.isdir(folder) and os.listdir(folder) == ["tensorboard"]
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0
    deadline = time.monotonic() + 5
    while os.path.exists(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(folder)
