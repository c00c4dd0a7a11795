"""How a job's log and its restarts read for people: one place for the service's log API,
``gpulab jobs logs`` / ``show`` and the notebook's JobView (the standard library only).

**A log as a terminal shows it.** Programs redraw a line in place: Keras' progress bar
writes ``\\b`` × the old width, then ``\\r`` and the new bar (tf-keras does so whenever
stdout is not a terminal too, on every POSIX system), tqdm writes ``\\r``, others colour
their words with ANSI escape sequences. A log file holds every redraw; `render` gives what a
terminal would show: each line in its last state, control characters and escape sequences
gone (colours are dropped, not drawn: the API, the CLI and the widget give plain text).

A line still being redrawn has no ``\\n`` yet, and it may span any number of reads. The
service keeps no state between reads: it starts each rendering at the start of the line
that was still open where the reader stopped (`open_line_start`) and says so (``from`` below
the reader's ``offset``); the reader replaces its own open line with the new text
(`merge`). So a bar redrawn across two reads shows once, in its newest state.

**Restarts.** Each restart of a replica is a record (`restart_record`) in the job's view;
`restart_line` says it in one line (CLI, JobView) and `restart_marker` is the line written
into that replica's log where the new attempt starts.
"""

from __future__ import annotations

import re
import signal
import time
from typing import Mapping

#: how far before a reader's offset the service looks for the start of the open line
#: (a line redrawn longer than that is rendered from the first redraw within it)
LINE_BACK = 64 * 1024

# an escape sequence: CSI (ESC [ … final byte), OSC (ESC ] … BEL or ESC \), or a 2-byte one
_ESC = r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\^_])"
_TOKEN = re.compile(
    rf"(?P<esc>{_ESC})|(?P<cr>\r)|(?P<nl>\n)|(?P<bs>\x08+)"
    r"|(?P<partial>\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*)?$)"  # cut off at the end of a read
    r"|(?P<ctl>[\x00-\x07\x0b-\x1a\x1c-\x1f\x7f]+|\x1b)"  # other controls (tab is text)
    r"|(?P<text>[^\x00-\x08\x0a-\x1f\x7f]+)")
_CSI = re.compile(r"\x1b\[([0-?]*)[ -/]*([@-~])")


class _Line:
    """One terminal line: its characters and the cursor."""

    __slots__ = ("chars", "col")

    def __init__(self) -> None:
        self.chars: list[str] = []
        self.col = 0

    def write(self, text: str) -> None:
        end = self.col + len(text)  # the cursor is never past the line's end
        self.chars[self.col:end] = text
        self.col = end

    def csi(self, params: str, final: str) -> None:
        """The control sequences that change a line: erase to its end (K) or all of it (2K,
        the cursor back at its start), cursor moves along it (G, C, D), never past the
        line's end: a log's few bytes never make a long line of blanks (what the service
        renders is never longer than what it read). Every other one (colours: m) changes
        nothing here."""
        try:
            n = int(params.split(";")[0][:9] or 0)
        except ValueError:
            return
        if final == "K":
            if n == 0:
                del self.chars[self.col:]
            elif n == 2:
                self.chars, self.col = [], 0
        elif final == "G":
            self.col = min(max(0, n - 1), len(self.chars))
        elif final == "C":
            self.col = min(self.col + max(1, n), len(self.chars))
        elif final == "D":
            self.col = max(0, self.col - max(1, n))

    def text(self) -> str:
        return "".join(self.chars).rstrip()


def render(text: str) -> tuple[str, str]:
    """``text`` (beginning at the start of a line) as a terminal shows it: (its finished
    lines, each ending with ``\\n``, without trailing spaces; the last line, still open, in
    its current state).

    >>> render("Epoch 1/2\\n1/5 [==>....]\\x08\\x08\\x08\\x08\\x08\\x08\\x08\\x08\\x08\\x08\\x08\\x08\\r5/5 [======]\\n")
    ('Epoch 1/2\\n5/5 [======]\\n', '')
    """
    lines: list[str] = []
    line = _Line()
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "text":
            line.write(m.group())
        elif kind == "nl":
            lines.append(line.text())
            line = _Line()
        elif kind == "cr":
            line.col = 0
        elif kind == "bs":
            line.col = max(0, line.col - len(m.group()))
        elif kind == "esc":
            csi = _CSI.fullmatch(m.group())
            if csi:
                line.csi(*csi.groups())
        # ctl, partial: nothing shows
    done = "".join(f"{ln}\n" for ln in lines)
    # the open line keeps its trailing spaces: a reader may add the next read's text to it
    return done, "".join(line.chars)


def render_text(text: str) -> str:
    """All of ``text`` rendered: its finished lines and the open one (no ``\\n`` after it)."""
    done, open_line = render(text)
    return done + open_line


def open_line_start(before: bytes, from_start: bool = False) -> int:
    """Where, in ``before`` (the bytes just before a reader's offset, at most `LINE_BACK`),
    the line still open at that offset starts: after the last ``\\n``; where none is
    within, at the log's start if ``before`` begins there (``from_start``), else at the first
    ``\\r`` (a redraw: what came before it on that line is drawn over), else at the offset
    itself (``len(before)``: the reader's open line is kept, the new text added to it)."""
    nl = before.rfind(b"\n")
    if nl >= 0:
        return nl + 1
    if from_start:
        return 0
    cr = before.find(b"\r")
    return cr if cr >= 0 else len(before)


def merge(shown: str, text: str, rewound: bool) -> str:
    """What a reader shows after a read: ``shown`` (rendered text so far) with ``text`` (the
    rendered piece) added. ``rewound``: the piece starts before where the reader asked (at
    the start of the line that was open there, ``from`` < ``offset``): it replaces the
    reader's open line (the text after its last ``\\n``)."""
    if rewound:
        shown = shown[: shown.rfind("\n") + 1]
    return shown + text


def finished_part(text: str) -> tuple[str, str]:
    """(the finished lines of rendered ``text``, its open last line)."""
    cut = text.rfind("\n") + 1
    return text[:cut], text[cut:]


# -- restarts ------------------------------------------------------------------------------


def signal_name(code: int | None) -> str | None:
    """The signal that ended a process with exit ``code`` (``-9``: a child killed by a
    signal; ``137``: 128 + the signal, as a container's shell reports it), or None."""
    if code is None:
        return None
    number = -code if code < 0 else code - 128 if 128 < code < 160 else None
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def restart_record(*, restart: int, at: float, exit_code: int | None, reason: str,
                   oom_killed: bool = False, **extra) -> dict:
    """One restart of a replica, as the job's view keeps it (``replicas[].restart_history``):
    ``restart`` (1 for the first), ``attempt`` (the run it started; the first run is 1),
    ``at`` (Unix time), ``exit_code`` of the attempt that ended (None: it was stopped to
    restart with others), ``signal`` (its name, where a signal ended it), ``oom_killed``
    and ``reason`` in words. ``extra``: what a driver adds (e.g. ``pod``)."""
    return {"restart": restart, "attempt": restart + 1, "at": at, "exit_code": exit_code,
            "signal": signal_name(exit_code), "oom_killed": bool(oom_killed),
            "reason": reason, **extra}


def restart_cause(record: Mapping) -> str:
    """Why the attempt before a restart ended: ``killed by SIGKILL (exit -9)``."""
    why = str(record.get("reason") or "")
    code = record.get("exit_code")
    if record.get("oom_killed") and "out of memory" not in why:
        why = f"killed: out of memory{f' ({why})' if why else ''}"
    if not why:
        why = f"killed by {record['signal']}" if record.get("signal") else (
            "ended" if code is None else f"exited {code}")
    if code is not None and not re.search(rf"\bexit(ed)? {re.escape(str(code))}\b", why):
        why += f" (exit {code})"
    return why


def _clock(at) -> str:
    try:
        return time.strftime("%H:%M:%S", time.localtime(float(at)))
    except (TypeError, ValueError, OverflowError):
        return "?"


def restart_line(replica: str, record: Mapping) -> str:
    """One line for a restart (CLI, JobView): ``worker-0: restart 1 at 14:05:31 (attempt
    2): killed by SIGKILL (exit -9)``; times local."""
    return (f"{replica}: restart {record.get('restart', '?')} at {_clock(record.get('at'))} "
            f"(attempt {record.get('attempt', '?')}): {restart_cause(record)}")


def restart_lines(view: Mapping) -> list[str]:
    """A line per restart of any replica of a job's view, oldest first."""
    found = []
    for r in view.get("replicas") or ():
        name = r.get("name") or f"{r.get('role')}-{r.get('index')}"
        for rec in r.get("restart_history") or ():
            if isinstance(rec, Mapping):
                found.append((rec.get("at") or 0, name, rec))
    found.sort(key=lambda x: (x[0], x[1]))
    return [restart_line(name, rec) for _, name, rec in found]


def restart_marker(role: str, index: int, record: Mapping) -> str:
    """The line written into a replica's log where a restarted attempt starts: ``--- restart
    1 of worker 0 at 14:05:31: previous attempt killed by SIGKILL (exit -9) ---``."""
    return (f"--- restart {record.get('restart', '?')} of {role} {index} at "
            f"{_clock(record.get('at'))}: previous attempt {restart_cause(record)} ---")
