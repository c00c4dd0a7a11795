"""A GPU notebook that waits in the GPU queue (LocalGPUSpawner): the option, and the pure
decisions of the wait.

The person chooses in the spawn form (or the REST API's ``user_options``) how long their
server may wait for busy GPUs: ``gpu_wait_minutes``, one of `WAIT_CHOICES` up to
``c.GPUQueue.longest_notebook_wait_minutes``; 0 (the default) refuses at once, as without
a queue. The spawner's wait loop (`gpulab.spawner.local.LocalGPUSpawner.admit_gpus`) runs
a scheduling pass about every second and acts on its entry's state (`decide`); the
spawn-pending page shows `progress_message`.
"""

from __future__ import annotations

import time
from typing import Mapping

from gpulab.extensions.jobmodel import queue_text

from gpulab.hub.quota.waiting import LEFT_REASON

from .profiles import OptionError, _short, is_plain_number

#: the ``user_options`` key (and the spawn form's field) of the longest wait, in minutes
WAIT_KEY = "gpu_wait_minutes"
#: the waits a person may choose, in minutes (0: do not wait), up to the operator's cap
WAIT_CHOICES = (0, 5, 15, 60)


def allowed_waits(longest: int) -> tuple[int, ...]:
    """The choices up to `longest` minutes (``c.GPUQueue.longest_notebook_wait_minutes``)."""
    return tuple(m for m in WAIT_CHOICES if m <= longest)


def wait_label(minutes: int) -> str:
    return "don't wait" if minutes == 0 else f"wait up to {minutes} min"


def parse_wait_minutes(options: Mapping | None, longest: int) -> int:
    """The wait chosen in `options` (absent: 0), or `OptionError` with the allowed values.

    Accepted: an int, or its digits as a string (a form's field, or a list of one such
    string as a pass-through form sends it); never a bool or a float."""
    if not options or WAIT_KEY not in options:
        return 0
    value = options[WAIT_KEY]
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    allowed = allowed_waits(longest)
    minutes = None
    if isinstance(value, int) and not isinstance(value, bool):
        minutes = value
    elif isinstance(value, str) and is_plain_number(value.strip()) and len(value) <= 6:
        minutes = int(value.strip())
    if minutes is None or minutes not in allowed:
        if allowed == (0,):
            raise OptionError(f"'{WAIT_KEY}' must be 0: this hub does not let servers wait "
                              f"for busy GPUs (got {_short(value)}).")
        raise OptionError(f"'{WAIT_KEY}' (how long your server may wait for busy GPUs, in "
                          f"minutes; 0: don't wait) must be one of "
                          f"{', '.join(map(str, allowed))}, got {_short(value)}.")
    return minutes


def decide(entry) -> tuple[str, str]:
    """What the wait loop does with its queue entry (a `gpulab.hub.quota.waiting.Entry`, or
    None when it is gone): ``("wait", "")``, ``("admitted", "")`` (adopt its allocation), or
    ``("refused", message)`` (the start fails with that message)."""
    if entry is None:
        return "refused", "Your server's place in the GPU queue is gone; nothing was started."
    if entry.state == "admitted":
        return "admitted", ""
    if entry.state == "cancelled":
        if not entry.reason or entry.reason == LEFT_REASON:
            return "refused", ("You left the queue: your server was not started, and it "
                               "holds no GPUs.")
        return "refused", (f"Your server is out of the GPU queue: {entry.reason.rstrip('.')}. "
                           "It was not started, and it holds no GPUs.")
    if entry.state == "expired":
        return "refused", entry.reason or ("The longest wait chosen passed before GPUs were "
                                           "free; nothing was started.")
    return "wait", ""


def progress_message(entry, now: float | None = None) -> str:
    """The spawn-pending page's line for a waiting entry (`Queue.entries`' view of it, with
    its place): ``Waiting for GPUs: 2nd in line · starts in about 12 min (14:05) · 4 GPUs of
    work ahead · <why it waits> · you may wait until 14:20``."""
    now = time.time() if now is None else now
    where = queue_text({"queue": {"position": entry.position,
                                  "estimated_start": entry.estimated_start}}, now)
    parts = [f"Waiting for GPUs: {where}"]
    if entry.ahead_gpus:
        parts.append(f"{entry.ahead_gpus} GPU{'s' if entry.ahead_gpus != 1 else ''} of work "
                     "ahead")
    if entry.reason:
        parts.append(entry.reason.rstrip("."))
    if entry.wait_until:
        parts.append("you wait until " + time.strftime("%H:%M", time.localtime(entry.wait_until)))
    return " · ".join(parts)
