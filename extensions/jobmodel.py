"""What the notebook widgets and the cell magic show and check, as plain functions.

No ipywidgets and no tornado here (the widgets in `gpulab.extensions.widgets` are thin views
over this): building a job spec from a form, whether the service can admit it (and why not,
in words), the program to run from a notebook cell, a function or a file, elapsed time,
progress, the replica table, a log tail and TensorBoard's address.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import secrets
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping
from urllib.parse import quote

from .contract import FINAL, NAME_RE, STRATEGIES
from .contract import PROGRESS_PREFIX as PROGRESS_LINE
from .joblog import merge
MEMORY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$")
MAX_NAME_LENGTH = 40
CODE_SOURCES = ("cell", "function", "file", "text")
#: where the server extension serves TensorBoard, below the server's prefix
TENSORBOARD_PATH = "tensorboard/"
#: a marker for lines of a cell that only make the launcher, left out of the program
_LAUNCHER_WORDS = ("TrainingLauncher", "gpulab.extensions.widgets")


def unique_name(prefix: str = "nb") -> str:
    """A fresh job name such as ``nb-20261203-101502-k3q`` (jobs are history: names are once)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    tail = "".join(secrets.choice(alphabet) for _ in range(3))
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{tail}"


def build_spec(*, name: str, strategy: str = "parameter-server", ps: int = 1,
               workers: int = 1, gpus: int = 0, cpu: float | None = None,
               memory: str | None = None, source: str | None = None,
               script: str | None = None, args=(), env: Mapping[str, str] | None = None,
               max_runtime: int | None = None, retries: int | None = None,
               image: str | None = None, evaluator: bool = False,
               files: Mapping[str, str] | Iterable[str | os.PathLike] | None = None,
               wait: bool | None = None, priority: int | None = None,
               preemptible: bool | None = None) -> dict:
    """The jobs API's spec from the launcher's fields.

    ``files``: more files of the program, placed beside ``source`` (the entry point) and
    importable by it: ``{name: text}``, or paths of files to read (relative ones from the
    current folder, a notebook's own), sent by their names (`read_files`).

    ``gpus``, ``cpu`` and ``memory`` are each worker's (every worker gets the same); a
    parameter-server job gets 1 chief and ``ps`` parameter servers, a multi-worker job only
    ``workers``. The service checks the result and names the field it refuses.

    ``wait=False``: start now or be refused (by default a job whose GPUs are busy waits in
    the queue); ``priority`` orders the person's own queued jobs; ``preemptible`` lets the
    job borrow idle GPUs beyond the quota (it may be stopped and resumed from its checkpoint).
    """
    replicas: dict = {"worker": workers}
    if strategy == "parameter-server":
        replicas = {"chief": 1, "ps": ps, "worker": workers}
    if evaluator:
        replicas["evaluator"] = 1
    worker: dict = {"gpus": gpus}
    if cpu is not None:
        worker["cpu"] = cpu
    if memory:
        worker["memory"] = memory
    spec: dict = {"name": name, "strategy": strategy, "replicas": replicas,
                  "resources": {"worker": worker}}
    if source is not None:
        spec["source"] = source
    if files:
        spec["files"] = (dict(files) if isinstance(files, Mapping) else read_files(files))
    if script is not None:
        spec["script"] = script
    if args:
        spec["args"] = [str(a) for a in args]
    if env:
        spec["env"] = dict(env)
    if max_runtime is not None:
        spec["max_runtime"] = max_runtime
    if retries is not None:
        spec["retries"] = retries
    if image:
        spec["image"] = image
    for key, value in (("wait", wait), ("priority", priority), ("preemptible", preemptible)):
        if value is not None:
            spec[key] = value
    return spec


def read_files(paths: Iterable[str | os.PathLike]) -> dict[str, str]:
    """``{name: text}`` of files to send with a job's ``source`` (each by its own file name;
    relative paths from the current folder). `ValueError` with one line for the person when
    one cannot be read or two have the same name."""
    out: dict[str, str] = {}
    for raw in paths:
        path = Path(raw)
        if path.name in out:
            raise ValueError(f"two files are named {path.name}: the files of a job go in one "
                             "folder, by their names")
        try:
            out[path.name] = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read {raw}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"{raw} is not UTF-8 text") from None
    return out


def spec_gpus(spec: Mapping) -> int:
    """GPUs the whole job holds: the sum over its replicas."""
    replicas = spec.get("replicas") or {}
    resources = spec.get("resources") or {}
    return sum(int(n or 0) * int((resources.get(role) or {}).get("gpus") or 0)
               for role, n in replicas.items())


# -- admission, as far as the notebook can tell ---------------------------------------------


def check_form(*, name: str, strategy: str, ps: int, workers: int, gpus: int,
               cpu: float | None = None, memory: str | None = None,
               code: str | None = None, script: str | None = None) -> list[str]:
    """What is wrong with the form itself, in words (empty: nothing)."""
    problems = []
    if not name:
        problems.append("Give the job a name.")
    elif len(name) > MAX_NAME_LENGTH or not NAME_RE.match(name):
        problems.append(f"The name '{name}' must be lower-case letters, digits and '-', start "
                        f"with a letter, not end with '-', at most {MAX_NAME_LENGTH} characters.")
    if strategy not in STRATEGIES:
        problems.append(f"The strategy must be one of {', '.join(STRATEGIES)}.")
    if strategy == "parameter-server" and (ps is None or ps < 1):
        problems.append("A parameter-server job needs at least 1 parameter server.")
    if workers is None or workers < 1:
        problems.append("A job needs at least 1 worker.")
    if gpus is None or gpus < 0:
        problems.append("GPUs per worker cannot be negative.")
    if cpu is not None and cpu <= 0:
        problems.append("CPUs per worker must be more than 0 (or left empty).")
    if memory and not MEMORY_RE.match(memory):
        problems.append(f"Memory '{memory}' is not a size such as 8Gi or 512Mi.")
    if script is None and not (code or "").strip():
        problems.append("There is no code to run.")
    return problems


def check_available(me: Mapping | None) -> list[str]:
    """Why this hub runs no training jobs at all, in the service's words (empty: it does).
    ``me`` is the service's ``GET me``; None skips the check."""
    if not me:
        return []
    if "jobs" not in me:  # a service from before jobs were announced in `me`
        return []
    jobs = me["jobs"]
    if jobs is None:
        return ["Training jobs are not set up on this hub."]
    if jobs.get("available") is False:
        return [jobs.get("reason") or "Training is off on this hub."]
    return []


def check_quota(requested: int, me: Mapping | None) -> list[str]:
    """Why the service would refuse ``requested`` GPUs now, in words (empty: it would not
    refuse for GPUs). ``me`` is the service's ``GET me``; None skips the check."""
    if not me or requested <= 0:
        return []
    problems = []
    quota = me.get("quota") or {}
    held = int(me.get("gpus_held") or 0)
    what = "GPU" if requested == 1 else "GPUs"
    max_gpus = quota.get("max_gpus")
    if max_gpus is not None and held + requested > max_gpus:
        holders = ", ".join(f"{h['kind']} '{h['name']}' ({h['gpus']})"
                            for h in me.get("holdings") or () if h.get("gpus"))
        problems.append(f"This job needs {requested} {what}, but your quota is {max_gpus} at "
                        f"once and {held} {'is' if held == 1 else 'are'} in use"
                        + (f": {holders}." if holders else "."))
    per = quota.get("max_per_request")
    if per is not None and requested > per:
        problems.append(f"This job needs {requested} {what}; your quota allows at most {per} "
                        "in one request.")
    inventory = me.get("inventory") or {}
    free = inventory.get("free")
    if free is not None and requested > free:
        problems.append(f"This job needs {requested} {what}, but only {free} of the hub's "
                        f"{inventory.get('total', '?')} {'is' if free == 1 else 'are'} free now.")
    return problems


def quota_summary(me: Mapping | None, simulated: str = " (simulated)") -> str:
    """One line: the quota, what is held, what is free on the hub (`simulated` follows the
    GPUs where they are simulated; the widgets show a "Simulated" pill instead)."""
    if not me:
        return "Quota unknown."
    inv = me.get("inventory") or {}
    sim = simulated if inv.get("simulated") else ""
    return (f"Your quota: {me.get('quota_text') or 'no limit'}; in use: "
            f"{me.get('gpus_held', 0)}; free on the hub: {inv.get('free', '?')} of "
            f"{inv.get('total', '?')} GPUs{sim}.")


def stop_question(name: str, gpus: int | None) -> str:
    """What Stop asks before it stops job `name` holding `gpus` GPUs."""
    if not gpus:
        return f"Stop job {name}? Every replica ends."
    held = "its GPU is" if gpus == 1 else f"its {gpus} GPUs are"
    return f"Stop job {name}? Every replica ends and {held} released."


def is_kubernetes(me: Mapping | None, env: Mapping[str, str] | None = None) -> bool:
    """Whether jobs run on Kubernetes (the only backend that takes an ``image``): the service
    says so (``me.jobs.backend``), else this server runs in a pod."""
    env = os.environ if env is None else env
    backend = ((me or {}).get("jobs") or {}).get("backend") or (me or {}).get("backend")
    if backend:
        return backend == "kubernetes"
    return bool(env.get("KUBERNETES_SERVICE_HOST"))


# -- the program to run -----------------------------------------------------------------


def cell_program(cell: str) -> str:
    """The training program in a notebook cell that also makes the launcher: the cell's code
    without the statements that import or make the launcher, and without IPython magics."""
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        lines = [ln for ln in cell.splitlines()
                 if not any(w in ln for w in _LAUNCHER_WORDS) and not ln.lstrip().startswith("%")]
        return "\n".join(lines).strip() + "\n" if any(ln.strip() for ln in lines) else ""
    lines = cell.splitlines()
    keep = []
    for node in tree.body:
        text = "\n".join(lines[node.lineno - 1: node.end_lineno])
        if any(w in text for w in _LAUNCHER_WORDS):
            continue
        keep.append(text)
    program = "\n".join(keep).strip()
    return program + "\n" if program else ""


def function_program(fn) -> str:
    """A program that defines ``fn`` (as written in the notebook) and calls it."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError) as e:
        raise ValueError(f"The code of {getattr(fn, '__name__', fn)!r} cannot be found: {e}") from e
    return textwrap.dedent(src).rstrip() + f"\n\n\n{fn.__name__}()\n"


def notebook_functions(namespace: Mapping) -> dict:
    """The functions defined in a notebook (its ``__main__`` namespace), by name."""
    return {name: obj for name, obj in sorted(namespace.items())
            if inspect.isfunction(obj) and getattr(obj, "__module__", None) == "__main__"
            and not name.startswith("_")}


def python_files(folder: str | os.PathLike | None, depth: int = 3, limit: int = 200) -> list[str]:
    """``.py`` files in a person's folder (relative paths, sorted), skipping hidden folders
    and the jobs folder; what a job's ``script`` may name."""
    if not folder or not os.path.isdir(folder):
        return []
    root = Path(folder)
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                             and not (rel == Path(".") and d == "jobs")
                             and len(rel.parts) < depth)
        for f in sorted(filenames):
            if f.endswith(".py") and not f.startswith("."):
                found.append(str(rel / f) if rel != Path(".") else f)
                if len(found) >= limit:
                    return found
    return found


# -- watching a job ---------------------------------------------------------------------


def elapsed(view: Mapping, now: float | None = None) -> float | None:
    """Seconds the job has run (until it ended); None before it started."""
    start = view.get("started_at")
    if not start:
        return None
    end = view.get("finished_at") or (time.time() if now is None else now)
    return max(0.0, end - start)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_of(view: Mapping) -> tuple[int, int, float] | None:
    """(step, total, fraction 0..1) when the job reported a step count, else None."""
    p = view.get("progress") or None
    if not p:
        return None
    step, total = p.get("step"), p.get("total")
    if not isinstance(step, int) or not isinstance(total, int) or total <= 0:
        return None
    step = max(0, min(step, total))
    return step, total, step / total


def progress_text(view: Mapping) -> str:
    """``step 40 of 100 (40%) · epoch 2 · loss 0.1234`` (empty when nothing was reported)."""
    p = view.get("progress") or None
    if not p or not isinstance(p.get("step"), int):
        return ""
    known = progress_of(view)
    parts = [f"step {known[0]} of {known[1]} ({known[2]:.0%})" if known else f"step {p['step']}"]
    for key, value in p.items():
        if key in ("step", "total", "time"):
            continue
        if isinstance(value, float):
            parts.append(f"{key} {value:.4g}")
        elif isinstance(value, (int, str)):
            parts.append(f"{key} {value}")
    return " · ".join(parts)


REPLICA_COLUMNS = ("replica", "state", "restarts", "exit code", "GPUs", "GPU use", "reason")


def replica_rows(view: Mapping) -> list[dict]:
    """The replica table: one dict a row with the `REPLICA_COLUMNS` (strings)."""
    rows = []
    for r in view.get("replicas") or ():
        rows.append({
            "replica": r.get("name") or f"{r.get('role')}-{r.get('index')}",
            "state": r.get("state") or "",
            "restarts": str(r.get("restarts") or 0),
            "exit code": "" if r.get("exit_code") is None else str(r["exit_code"]),
            "GPUs": ",".join(str(d) for d in r.get("devices") or ()) or "–",
            # while it runs, how busy each of its GPUs is (the service's words, from NVML)
            "GPU use": "; ".join(u.get("text", "") for u in r.get("usage") or ()),
            "reason": r.get("reason") or "",
        })
    return rows


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def queue_text(view: Mapping, now: float | None = None) -> str:
    """Where a waiting job stands: ``2nd in line · starts in about 12 min (14:05)``,
    ``next in line · start unknown``, ``held by an admin``; "" when it does not wait."""
    q = view.get("queue") or None
    if not isinstance(q, Mapping):
        return ""
    position = q.get("position")
    if not isinstance(position, int):
        return "held by an admin"
    where = "next in line" if position == 1 else f"{_ordinal(position)} in line"
    start = q.get("estimated_start")
    if not isinstance(start, (int, float)):
        return f"{where} · start unknown{_unknown_why(q.get('reason'))}"
    now = time.time() if now is None else now
    wait = start - now
    if wait <= 30:
        return f"{where} · starts in a moment"
    clock = time.strftime("%H:%M", time.localtime(start))
    if wait < 3600:
        return f"{where} · starts in about {max(1, round(wait / 60))} min ({clock})"
    return f"{where} · starts in about {wait / 3600:.1f} h ({clock})"


def _unknown_why(reason) -> str:
    """``: a notebook using them has no time limit``: why the queue's reason says the start
    is unknown, short enough for a state line ("" when it does not say)."""
    if not isinstance(reason, str):
        return ""
    m = re.search(r"start unknown: ([^:;()]+)", reason)
    if m:
        return ": " + m.group(1).strip().rstrip(".")
    if reason.startswith("Waits for GPU-hour budget"):
        return ": waits for GPU-hour budget"
    return ""


def queue_reason(view: Mapping) -> str:
    """Why a queued job waits, in the queue's words (shown under its state line: it is long);
    "" when it does not wait or the queue does not say."""
    if view.get("state") != "Queued":
        return ""
    q = view.get("queue")
    reason = (q.get("reason") if isinstance(q, Mapping) else None) or view.get("reason")
    return reason if isinstance(reason, str) else ""


def state_line(view: Mapping, now: float | None = None) -> str:
    """``Running · 4 GPUs · 1:02``, ``Failed · chief-0 exited 1 · 3:10`` or
    ``Queued · 2nd in line · starts in about 12 min (14:05) · 4 GPUs``."""
    parts = [view.get("state") or "?"]
    waiting = queue_text(view, now)
    if waiting:
        parts.append(waiting)
    if view.get("reason") and view.get("state") not in ("Running", "Queued"):
        parts.append(str(view["reason"]))
    if view.get("gpus"):
        parts.append(f"{view['gpus']} GPU{'s' if view['gpus'] != 1 else ''}")
    parts.append(format_duration(elapsed(view, now)))
    return " · ".join(parts)


def is_final(view: Mapping | None) -> bool:
    return bool(view) and view.get("state") in FINAL


@dataclass
class LogTail:
    """The end of one replica's log, fed piece by piece from ``GET …/logs/<replica>``.

    Reads go on from `offset`; when the log has grown by more than `max_chars` since (a long
    log seen for the first time, or a view that fell behind), the next read skips to its last
    `max_chars` bytes; a log that got shorter (replaced) is read again from its start.
    """

    replica: str
    max_chars: int = 32 * 1024
    offset: int = 0
    text: str = ""
    done: bool = False

    def feed(self, piece: Mapping) -> bool:
        """Add a piece (``{text, offset, from, size, done}``: the log API's answer, text
        rendered as a terminal shows it); True if the text changed. A piece that starts
        before where this tail asked (``from`` < `offset`: the line still open there, in its
        newest state) replaces the tail's own open last line (`joblog.merge`)."""
        self.done = bool(piece.get("done"))
        size = int(piece.get("size", 0))
        offset = int(piece.get("offset", self.offset))
        text = piece.get("text") or ""
        rewound = int(piece.get("from", self.offset)) < self.offset
        if size < offset:  # the log was replaced by a shorter one
            self.offset, changed = 0, bool(self.text)
            self.text = ""
            return changed
        if size - offset > self.max_chars:  # far behind: what was read is older than the tail
            self.offset = size - self.max_chars
            if text:
                self.text = ""
                return True
            return False
        self.offset = offset
        if not text:
            return False
        before = self.text
        self.text = merge(self.text, text, rewound)[-self.max_chars:]
        return self.text != before

    def lines(self, n: int) -> str:
        """The last `n` lines, without the runtime's progress lines (they are shown as the
        job's progress bar, not as text)."""
        return "\n".join([ln for ln in self.text.splitlines()
                          if not ln.startswith(PROGRESS_LINE)][-n:])


def has_tensorboard_logs(folder: str | os.PathLike, limit: int = 2000) -> bool:
    """Whether a job's TensorBoard folder holds an event file (``events.out.tfevents.*``)
    anywhere below it (at most `limit` entries are looked at)."""
    seen = 0
    for _, dirnames, filenames in os.walk(folder):
        if any(f.startswith("events.out.tfevents.") for f in filenames):
            return True
        seen += len(dirnames) + len(filenames)
        if seen > limit:
            return True  # a folder that large holds runs: do not keep looking
    return False


def tensorboard_note(job: str, user_dir: str | os.PathLike | None) -> str:
    """What to say above a job's TensorBoard when the job has written no logs for it (its
    board is empty): how a program writes them. "" when it has, or when the job's folder
    is not to be seen here (no ``user_dir``)."""
    if not user_dir or not os.path.isdir(Path(user_dir) / "jobs" / job):
        return ""
    if has_tensorboard_logs(Path(user_dir) / "jobs" / job / "tensorboard"):
        return ""
    return (f"Job {job} has written no TensorBoard logs (yet), so its board is empty. A "
            "program writes them to the job's folder for them, runtime.logdir() (from "
            "gpulab.extensions import runtime): with Keras, "
            "model.fit(..., callbacks=[tf.keras.callbacks.TensorBoard(log_dir=runtime.logdir())]); "
            "in a custom loop, tf.summary.create_file_writer(runtime.writable_dir(runtime.logdir())).")


def tensorboard_url(job: str | None = None, prefix: str | None = None) -> str:
    """TensorBoard in the person's own server (``<JUPYTERHUB_SERVICE_PREFIX>tensorboard/``):
    all runs, or one job's (``?runFilter=^<job>/``, runs are ``<job>/tensorboard/…``)."""
    if prefix is None:
        prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX") or "/"
    url = prefix.rstrip("/") + "/" + TENSORBOARD_PATH
    if job:
        url += "?runFilter=" + quote(f"^{job}/", safe="") + "#timeseries"
    return url
