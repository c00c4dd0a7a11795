"""Process helpers of one machine, for the spawners, the job backend and the CLI."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (zombies count as gone); 0 or negative: no process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
