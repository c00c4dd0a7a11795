"""Logs as a terminal shows them, and restarts in words (`gpulab.extensions.joblog`), with
literal inputs: a Keras progress bar as tf-keras writes it to a job's log (captured from
`Model.fit` with the default ``verbose`` under tf-keras 2.x, stdout a file), ANSI colour
codes (Keras 3's bar), ``\\b`` sequences and lines split across reads.

Streaming goes through the workflow's real `JobBackend.read_log_text` (the log API's answer)
over a log held in memory, read by the notebook's `LogTail` and the client's line follower
the way the JobView and ``gpulab jobs logs -f`` read them.
"""

import asyncio
import json
import signal
import time

import pytest

from gpulab.extensions import joblog
from gpulab.extensions.client import Job
from gpulab.extensions.jobmodel import LogTail
from gpulab.hub.jobs.base import JobBackend

BS80 = "\b" * 80
#: what tf-keras' `Model.fit` (verbose=1, 4 steps an epoch) wrote to a job's log, verbatim
#: but for the 80 backspaces written as BS80 (one redraw: 80 \b, then \r and the new bar)
KERAS_LOG = (
    "Epoch 1/2\n"
    "\r1/4 [======>.......................] - ETA: 1s - loss: 0.7480 - accuracy: 0.3750" + BS80 +
    "\r2/4 [==============>...............] - ETA: 0s - loss: 0.7409 - accuracy: 0.3438" + BS80 +
    "\r3/4 [=====================>........] - ETA: 0s - loss: 0.7404 - accuracy: 0.3958" + BS80 +
    "\r4/4 [==============================] - ETA: 0s - loss: 0.7283 - accuracy: 0.4062" + BS80 +
    "\r4/4 [==============================] - 1s 65ms/step - loss: 0.7283 - accuracy: 0.4062\n"
    "Epoch 2/2\n"
    "\r1/4 [======>.......................] - ETA: 0s - loss: 0.7621 - accuracy: 0.2500" + BS80 +
    "\r2/4 [==============>...............] - ETA: 0s - loss: 0.7290 - accuracy: 0.4062" + BS80 +
    "\r3/4 [=====================>........] - ETA: 0s - loss: 0.7340 - accuracy: 0.3750"
    "WARNING:tensorflow:Callback method `on_train_batch_end` is slow compared to the batch "
    "time (batch time: 0.0015s vs `on_train_batch_end` time: 0.0634s). Check your callbacks.\n"
    + BS80 +
    "\r4/4 [==============================] - ETA: 0s - loss: 0.7277 - accuracy: 0.3906" + BS80 +
    "\r4/4 [==============================] - 0s 68ms/step - loss: 0.7277 - accuracy: 0.3906\n")
KERAS_SHOWN = (
    "Epoch 1/2\n"
    "4/4 [==============================] - 1s 65ms/step - loss: 0.7283 - accuracy: 0.4062\n"
    "Epoch 2/2\n"
    "3/4 [=====================>........] - ETA: 0s - loss: 0.7340 - accuracy: 0.3750"
    "WARNING:tensorflow:Callback method `on_train_batch_end` is slow compared to the batch "
    "time (batch time: 0.0015s vs `on_train_batch_end` time: 0.0634s). Check your callbacks.\n"
    "4/4 [==============================] - 0s 68ms/step - loss: 0.7277 - accuracy: 0.3906\n")


def test_a_keras_bar_is_its_last_state():
    assert joblog.render(KERAS_LOG) == (KERAS_SHOWN, "")


def test_a_keras_bar_mid_epoch_is_the_open_line():
    done, open_line = joblog.render(KERAS_LOG[:KERAS_LOG.rindex("\r3/4")])
    assert done == "Epoch 1/2\n" + KERAS_SHOWN.splitlines(True)[1] + "Epoch 2/2\n"
    assert open_line == "2/4 [==============>...............] - ETA: 0s - loss: 0.7290 - accuracy: 0.4062"


# Keras 3's bar: bold step counts, a green and a grey bar, \r redraws
KERAS3 = ("\r\x1b[1m1/4\x1b[0m \x1b[32m━━━━━\x1b[0m\x1b[37m━━━━━━━━━━━━━━━\x1b[0m "
          "\x1b[1m0s\x1b[0m 5ms/step - accuracy: 0.3750 - loss: 0.7480"
          "\r\x1b[1m4/4\x1b[0m \x1b[32m━━━━━━━━━━━━━━━━━━━━\x1b[0m\x1b[37m\x1b[0m "
          "\x1b[1m0s\x1b[0m 4ms/step - accuracy: 0.4062 - loss: 0.7283\n")

CASES = [
    ("plain lines", "a\nb\n", ("a\nb\n", "")),
    ("carriage return redraw", "10%\r50%\r100%\n", ("100%\n", "")),
    ("a shorter redraw keeps the rest, as a terminal does", "abcdef\rxy\n", ("xycdef\n", "")),
    ("backspaces", "abc\b\bX\n", ("aXc\n", "")),
    ("backspace past the start stops there", "ab\b\b\b\bZ\n", ("Zb\n", "")),
    ("colours stripped", "\x1b[31mred\x1b[0m and \x1b[1;32mgreen\x1b[0m\n",
     ("red and green\n", "")),
    ("Keras 3's coloured bar", KERAS3,
     ("4/4 ━━━━━━━━━━━━━━━━━━━━ 0s 4ms/step - accuracy: 0.4062 - loss: 0.7283\n", "")),
    ("erase to the end of the line (tqdm, pip)", "downloading 10%\r\x1b[Kdone\n", ("done\n", "")),
    ("erase the whole line", "abc\x1b[2K\rxy\n", ("xy\n", "")),
    ("cursor to a column", "abcdef\x1b[3GZ\n", ("abZdef\n", "")),
    ("cursor moves stop at the line's end", "ab\x1b[99CZ\x1b[99GY\x1b[3DX\n", ("aXZY\n", "")),
    ("a title (OSC) and a bell vanish", "\x1b]0;title\x07ok\x07\n", ("ok\n", "")),
    ("CR LF ends a line", "windows\r\nline\r\n", ("windows\nline\n", "")),
    ("trailing padding is not kept", "loss 0.1   \n", ("loss 0.1\n", "")),
    ("tabs are text", "a\tb\n", ("a\tb\n", "")),
    ("an unfinished line is open", "done\nstep 3", ("done\n", "step 3")),
    ("an escape cut off at the end of a read shows nothing", "ok\nbar \x1b[3", ("ok\n", "bar ")),
    ("other control characters vanish", "a\x00b\x01c\x7f\n", ("abc\n", "")),
    ("a lone escape is dropped, not what follows", "a\x1b\x1bb\x1b[31mc\x1b", ("", "abc")),
    ("a title cut off at the end of a read", "x\x1b]0;tit", ("", "x")),
    ("two-character escapes", "x\x1bMy\x1b\\z\n", ("xyz\n", "")),
    ("empty", "", ("", "")),
]


@pytest.mark.parametrize("text, shown", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_render(text, shown):
    assert joblog.render(text) == shown


HOSTILE = [
    ("cursor far right", "\x1b[999999999G\x1b[99999999999999999999Cx\n" * 1000),
    ("erase in a long line", "x" * 100_000 + "\x1b[1K\x1b[2Kx" * 20_000),
    ("backspaces and controls", "\b\x01" * 200_000),
    ("escape starts", "\x1b[" * 100_000),
    ("nul bytes (a sparse file)", "\x00" * (1 << 20)),
]


@pytest.mark.parametrize("text", [c[1] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_a_hostile_log_renders_no_longer_than_it_is_and_fast(text):
    """What the service renders of a person's log (up to 1 MiB a read) is never longer than
    the bytes read, and takes linear time."""
    t0 = time.monotonic()
    shown = joblog.render_text(text)
    assert len(shown) <= len(text) and time.monotonic() - t0 < 2


@pytest.mark.parametrize("before, start", [
    (b"", 0),
    (b"line\npart", 5),
    (b"a\nb\n", 4),
    (b"bar 1" + b"\b" * 5 + b"\rbar 2", 10),  # no \n within: from the first redraw
    (b"x" * 10, 10),  # neither: from the offset itself
])
def test_open_line_start(before, start):
    assert joblog.open_line_start(before) == start


def test_a_first_line_starts_at_the_log_start():
    assert joblog.open_line_start(b"Epoch ", from_start=True) == 0
    assert joblog.open_line_start(b"a\nb", from_start=True) == 2


def test_merge_replaces_only_the_open_line():
    assert joblog.merge("a\nbar 1", "bar 2\nb\n", rewound=True) == "a\nbar 2\nb\n"
    assert joblog.merge("a\n", "b", rewound=False) == "a\nb"
    assert joblog.merge("bar 1", "bar 2", rewound=True) == "bar 2"


# -- streaming through the workflow's answer -------------------------------------------------


class MemoryLog(JobBackend):
    """`JobBackend.read_log_text` over a log in memory (no job rows: `read_log` is the only
    hook it uses). ``grow`` appends what the program writes next."""

    def __init__(self, limit: int = 1 << 20):
        self.data = b""
        self.limit = limit
        self.reads = []

    def grow(self, text: str) -> None:
        self.data += text.encode()

    async def read_log(self, user, name, replica, offset=0, limit=1 << 20):
        self.reads.append((offset, limit))
        return self.data[offset:offset + limit], len(self.data), False

    def answer(self, offset: int, raw: bool = False) -> dict:
        return asyncio.run(self.read_log_text("ann", "job", "worker-0", offset, raw=raw,
                                              limit=self.limit))


def split(text: str, n: int) -> list[str]:
    """`text` in pieces of `n` characters: reads that end anywhere, mid-redraw too."""
    return [text[i:i + n] for i in range(0, len(text), n)]


@pytest.mark.parametrize("piece", [1, 7, 33, 81, 200, 100_000])
def test_a_log_tail_fed_as_the_log_grows_shows_what_a_terminal_shows(piece):
    """The JobView's tail, reading after every write of the program (the bar redrawn across
    reads), ends with the one-shot rendering; while a bar is drawn, it shows it once."""
    log, tail = MemoryLog(), LogTail("worker-0", max_chars=1 << 20)
    for chunk in split(KERAS_LOG, piece):
        log.grow(chunk)
        tail.feed(log.answer(tail.offset))
        assert tail.text.count("Epoch 2/2") <= 1
        assert "\b" not in tail.text and "\r" not in tail.text
        opened = tail.text[tail.text.rfind("\n") + 1:]
        assert opened.count("/4 [") <= 1, opened  # one bar, never two glued together
    assert tail.text == KERAS_SHOWN


def test_reads_smaller_than_a_line_still_reach_its_end():
    """A line longer than one read (limit 50 here; 1 MiB in the service): each read moves on,
    the line is rendered from its start each time."""
    log = MemoryLog(limit=50)
    log.grow(KERAS_LOG)
    tail = LogTail("worker-0", max_chars=1 << 20)
    for _ in range(1000):
        before = tail.offset
        tail.feed(log.answer(tail.offset))
        if tail.offset == before:
            break
    assert tail.offset == len(log.data) and tail.text == KERAS_SHOWN


def test_the_raw_log_is_the_bytes_from_the_offset():
    log = MemoryLog()
    log.grow(KERAS_LOG)
    first = log.answer(0, raw=True)
    assert first["text"] == KERAS_LOG and first["from"] == 0
    again = log.answer(20, raw=True)
    assert again["text"] == KERAS_LOG[20:] and again["from"] == 20


def test_the_answer_says_where_its_text_starts():
    log = MemoryLog()
    log.grow("Epoch 1/2\n\r1/4 [==>...]")
    first = log.answer(0)
    assert first == {"replica": "worker-0", "offset": len(log.data), "from": 0,
                     "size": len(log.data), "text": "Epoch 1/2\n1/4 [==>...]", "done": False}
    log.grow("\b" * 12 + "\r2/4 [====>.]")
    second = log.answer(first["offset"])
    assert second["from"] == len("Epoch 1/2\n") and second["text"] == "2/4 [====>.]"


class LogJob(Job):
    """The real client's `Job` over `MemoryLog` instead of HTTP; ``script`` says what the
    program writes before each read (the job is done when it runs out)."""

    def __init__(self, log: MemoryLog, script: list[str]):
        self.log, self.script = log, list(script)
        self.name, self.view, self.user = "job", {"strategy": "multi-worker-mirrored"}, None

    def read_log(self, replica, offset=0, follow=False, raw=False):
        if self.script:
            self.log.grow(self.script.pop(0))
        return {**self.log.answer(offset, raw=raw), "done": not self.script}


def test_following_yields_each_finished_line_once_and_the_bar_in_place():
    job = LogJob(MemoryLog(), split(KERAS_LOG, 40))
    seen = list(job.follow_lines("worker-0"))
    assert "".join(finished for finished, _ in seen) == KERAS_SHOWN
    bars = [open_line for _, open_line in seen if open_line]
    assert bars and all("\b" not in b and "\r" not in b for b in bars)
    assert "2/4 [==============>...............] - ETA: 0s - loss: 0.7290 - accuracy: 0.4062" in bars
    # `logs(follow=True)`: the finished lines, each once; `logs()`: the whole text
    assert "".join(LogJob(MemoryLog(), split(KERAS_LOG, 40)).logs("worker-0", follow=True)) == KERAS_SHOWN
    assert LogJob(MemoryLog(), [KERAS_LOG]).logs("worker-0") == KERAS_SHOWN
    assert LogJob(MemoryLog(), [KERAS_LOG]).logs("worker-0", raw=True) == KERAS_LOG


def test_following_ends_with_an_unfinished_last_line():
    job = LogJob(MemoryLog(), ["a\n", "step 1", "\rstep 2"])
    assert "".join(job.logs("worker-0", follow=True)) == "a\nstep 2"


# -- restarts ---------------------------------------------------------------------------------

AT = time.mktime((2026, 12, 7, 14, 5, 31, 0, 0, -1))  # 14:05:31 local time


@pytest.mark.parametrize("code, name", [(-9, "SIGKILL"), (-15, "SIGTERM"), (137, "SIGKILL"),
                                        (143, "SIGTERM"), (1, None), (0, None), (None, None),
                                        (-1000, None)])
def test_signal_name(code, name):
    assert joblog.signal_name(code) == name


def test_a_restart_record():
    rec = joblog.restart_record(restart=1, at=AT, exit_code=-signal.SIGKILL,
                                reason="killed by SIGKILL")
    assert rec == {"restart": 1, "attempt": 2, "at": AT, "exit_code": -9, "signal": "SIGKILL",
                   "oom_killed": False, "reason": "killed by SIGKILL"}
    assert json.loads(json.dumps(rec)) == rec


RESTARTS = [
    ("killed", dict(exit_code=-9, reason="killed by SIGKILL"),
     "previous attempt killed by SIGKILL (exit -9)"),
    ("out of memory", dict(exit_code=-9, oom_killed=True, reason="killed: out of memory (the "
                           "default memory limit of replicas is 2Gi)"),
     "previous attempt killed: out of memory (the default memory limit of replicas is 2Gi) "
     "(exit -9)"),
    ("Kubernetes OOMKilled", dict(exit_code=137, oom_killed=True, reason=""),
     "previous attempt killed: out of memory (exit 137)"),
    ("its own words name the exit", dict(exit_code=1, reason="the program raised an error "
                                         "(exit 1)"),
     "previous attempt the program raised an error (exit 1)"),
    ("stopped with the others", dict(exit_code=None, reason="stopped to restart with worker-0"),
     "previous attempt stopped to restart with worker-0"),
    ("no words", dict(exit_code=3, reason=""), "previous attempt exited 3"),
]


@pytest.mark.parametrize("fields, words", [c[1:] for c in RESTARTS], ids=[c[0] for c in RESTARTS])
def test_restart_marker(fields, words):
    rec = joblog.restart_record(restart=1, at=AT, **fields)
    assert joblog.restart_marker("worker", 0, rec) == f"--- restart 1 of worker 0 at 14:05:31: {words} ---"


def test_restart_lines_of_a_view_oldest_first():
    view = {"replicas": [
        {"name": "worker-0", "restart_history": [
            joblog.restart_record(restart=1, at=AT, exit_code=-9, reason="killed by SIGKILL")]},
        {"name": "ps-0", "restart_history": [
            joblog.restart_record(restart=1, at=AT - 60, exit_code=-15,
                                  reason="killed by SIGTERM")]},
        {"name": "chief-0"},
    ]}
    assert joblog.restart_lines(view) == [
        "ps-0: restart 1 at 14:04:31 (attempt 2): killed by SIGTERM (exit -15)",
        "worker-0: restart 1 at 14:05:31 (attempt 2): killed by SIGKILL (exit -9)"]
    assert joblog.restart_lines({"replicas": [{"name": "w", "restart_history": ["junk"]}]}) == []


class Terminal(__import__("io").StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("tty", [True, False], ids=["terminal", "pipe"])
def test_gpulab_jobs_logs_follow_on_a_terminal_and_into_a_pipe(monkeypatch, tty):
    """``gpulab jobs logs -f``: on a terminal the bar is redrawn in place (what the terminal
    then shows is the log as rendered); into a pipe or file only finished lines, each once."""
    from gpulab.hub.cli.jobs import follow_logs

    out = Terminal() if tty else __import__("io").StringIO()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("gpulab.hub.cli.jobs._width", lambda: 200)
    follow_logs(LogJob(MemoryLog(), split(KERAS_LOG, 40) + ["Epoch 3/3\n\r1/4 [=>..]"]),
                "worker-0", True)
    written = out.getvalue()
    assert joblog.render_text(written) == KERAS_SHOWN + "Epoch 3/3\n1/4 [=>..]\n"
    assert ("\r\x1b[K" in written) is tty and "\b" not in written
    if not tty:
        assert written == KERAS_SHOWN + "Epoch 3/3\n1/4 [=>..]\n"
