"""Notebook widgets (ipywidgets 8) for training jobs: launch, watch, stop, TensorBoard.

    from gpulab.extensions.widgets import TrainingLauncher, JobView, JobsList, TensorBoard
    TrainingLauncher()          # a form; Launch submits and shows a JobView below it
    JobView("digits")           # a job's replicas, progress, logs, Stop and TensorBoard, live
    JobsList()                  # my jobs, with Open and Stop
    TensorBoard("digits")       # TensorBoard for one job (or all runs without a name)

Each is an ``ipywidgets.VBox`` with ``on_*`` callbacks (``on_launch``, ``on_submitted``,
``on_error``, ``on_stop``, ``on_open``). What they check and show is computed by
`gpulab.extensions.jobmodel` (plain functions); the service is reached through
`gpulab.extensions.client.Client`. Errors of the service appear as a message in the widget,
never as a traceback. Key parts carry stable CSS classes (``gpulab-…``) for browser tests.
"""

from __future__ import annotations

import html
import os
import threading
from typing import Callable, Mapping

import ipywidgets as W

from . import jobmodel as jm
from .client import Client, GpulabError, Job, lead_replica
from .contract import EXIT_NOT_RETRIED, FINAL
from .joblog import restart_lines

#: at most one request a second per view
MIN_INTERVAL = 1.0


class _Callbacks:
    def __init__(self):
        self._callbacks: dict[str, list[Callable]] = {}

    def _register(self, kind: str, callback: Callable, remove: bool = False) -> None:
        lst = self._callbacks.setdefault(kind, [])
        if remove:
            if callback in lst:
                lst.remove(callback)
        else:
            lst.append(callback)

    def _fire(self, kind: str, *args) -> list:
        return [cb(*args) for cb in list(self._callbacks.get(kind, ()))]


def _message(kind: str, text: str) -> str:
    """An HTML message line: kind is error, warning, ok or info."""
    colors = {"error": "#b00020", "warning": "#8a5300", "ok": "#1b6e20", "info": "#444"}
    return (f'<div class="gpulab-msg gpulab-msg-{kind}" style="color:{colors[kind]}">'
            f"{html.escape(text)}</div>")


#: "Simulated" as the hub's pages show it (Bootstrap's ``badge text-bg-warning``): one pill
#: style wherever gpulab says its GPUs are simulated
SIMULATED_PILL = ("<span class='gpulab-simulated' style='display:inline-block; padding:.25em "
                  ".6em; border-radius:.375rem; background:#ffc107; color:#000; font-size:.75em; "
                  "font-weight:700; line-height:1; vertical-align:baseline'>Simulated</span>")


def _quota_html(me: dict) -> str:
    """The quota line, with the "Simulated" pill where the hub's GPUs are simulated."""
    line = html.escape(jm.quota_summary(me, simulated=""))
    return line + (" " + SIMULATED_PILL if (me.get("inventory") or {}).get("simulated") else "")


#: what the launcher's quota line says while the quota is being read
_LOADING = ("<div class='gpulab-loading' style='color:var(--jp-ui-font-color2, #666)'>"
            "<i class='fa fa-spinner fa-spin' aria-hidden='true'></i> loading your quota and "
            "the free GPUs…</div>")


def _error_text(e: Exception) -> str:
    if isinstance(e, GpulabError):
        return e.message
    return f"{type(e).__name__}: {e}"


# -- TensorBoard ------------------------------------------------------------------------


class TensorBoard(W.VBox):
    """TensorBoard of the person's own server, embedded: one job's runs, or all of them.

    The server extension serves it at ``<JUPYTERHUB_SERVICE_PREFIX>tensorboard/`` over
    ``$GPULAB_USER_DIR/jobs`` (runs are ``<job>/tensorboard/…``); ``prefix`` overrides the
    server prefix, ``height`` is in pixels. A job that has written no TensorBoard logs gets
    a note above its (empty) board saying how a program writes them (``runtime.logdir()``);
    ``user_dir``: where the job folders are (default ``$GPULAB_USER_DIR``).
    """

    def __init__(self, job: str | None = None, *, prefix: str | None = None, height: int = 560,
                 user_dir: str | None = None):
        self.job, self.url = job, jm.tensorboard_url(job, prefix=prefix)
        caption = (f"TensorBoard: runs of job <b>{html.escape(job)}</b>" if job
                   else "TensorBoard: all your runs")
        self.caption = W.HTML(f'{caption} · <a href="{html.escape(self.url)}" target="_blank" '
                              'rel="noopener">open in a new tab</a>')
        note = jm.tensorboard_note(job, user_dir or os.environ.get("GPULAB_USER_DIR")) if job else ""
        #: how to write TensorBoard logs, for a job that has written none (else empty)
        self.note = W.HTML(_message("info", note) if note else "")
        self.note.add_class("gpulab-tensorboard-note")
        self.frame = W.HTML(
            f'<iframe class="gpulab-tensorboard-frame" src="{html.escape(self.url)}" '
            f'style="width:100%;height:{int(height)}px;border:1px solid #ddd" '
            f'title="TensorBoard"></iframe>')
        super().__init__([self.caption, self.note, self.frame])
        self.add_class("gpulab-tensorboard")


# -- JobView ----------------------------------------------------------------------------


def _replica_table(view: dict) -> str:
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{c}</th>"
                   for c in jm.REPLICA_COLUMNS)
    body = []
    for row in jm.replica_rows(view):
        cells = "".join(f"<td style='padding:2px 8px' class='gpulab-col-{c.replace(' ', '-')}'>"
                        f"{html.escape(row[c])}</td>" for c in jm.REPLICA_COLUMNS)
        body.append(f"<tr class='gpulab-replica' data-replica='{html.escape(row['replica'])}' "
                    f"data-state='{html.escape(row['state'])}'>{cells}</tr>")
    return (f"<table class='gpulab-replica-table'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


class JobView(W.VBox):
    """One job, live: state, replicas (state, restarts, exit code, GPUs), a line per restart
    (which replica, when, why), elapsed time, progress, the log tail of a chosen replica (as
    a terminal shows it: a progress bar redrawn in place is one line), Stop (with a confirmation) and TensorBoard.

    ``job`` is a `Job` or a name (then ``client`` or ``Client()`` is used). A background
    thread asks the service at most once a second (status and log in turn) until the job has
    ended or the view is closed; ``start=False`` leaves polling to explicit `refresh` calls.
    Callbacks: ``on_stop(callback)``: ``callback(view_dict)`` after Stop was confirmed;
    ``on_update(callback)``: ``callback(view_dict)`` after each status read.
    """

    def __init__(self, job: Job | str, client: Client | None = None, *,
                 interval: float = MIN_INTERVAL, log_lines: int = 30, start: bool = True,
                 tensorboard: bool = False, tensorboard_prefix: str | None = None):
        self._cb = _Callbacks()
        if isinstance(job, str):
            job = (client or Client()).job(job)
        self.job = job
        self.interval = max(MIN_INTERVAL, interval)
        self.log_lines = log_lines
        self._tb_prefix = tensorboard_prefix
        self._lock = threading.RLock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._tail: jm.LogTail | None = None
        self.view: dict | None = job.view

        self.title = W.HTML(f"<b style='white-space:nowrap'>Job {html.escape(job.name)}</b>")
        self.state = W.HTML("…")
        self.state.add_class("gpulab-job-state")
        self.replicas = W.HTML("")
        self.replicas.add_class("gpulab-replicas")
        #: a line per restart of a replica: which, when, why (empty while there is none)
        self.restarts = W.HTML("")
        self.restarts.add_class("gpulab-restarts")
        self.progress = W.FloatProgress(value=0.0, min=0.0, max=1.0,
                                        layout=W.Layout(width="50%", display="none"))
        self.progress.add_class("gpulab-progress")
        self.progress_label = W.HTML("")
        self.progress_label.add_class("gpulab-progress-text")
        #: the progress bar and its words; not shown (no empty band) while the job reported none
        self.progress_row = W.HBox([self.progress, self.progress_label],
                                   layout=W.Layout(display="none"))
        self.replica_choice = W.Dropdown(options=[], description="Log of",
                                         layout=W.Layout(width="auto"))
        self.replica_choice.add_class("gpulab-log-replica")
        #: the log's last lines as text (`log_text` shows them)
        self.log_plain = ""
        # a bottom-anchored box (flex, column-reverse): the newest line stays in sight as the
        # log grows, unless the person scrolled up to read
        self.log_text = W.HTML(value=_log_html(""), layout=W.Layout(width="100%"))
        self.log_text.add_class("gpulab-log")
        self._choosing = False  # the view, not the person, is choosing the replica
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop")
        self.stop_button.add_class("gpulab-stop")
        self.confirm_button = W.Button(description="Yes, stop it", button_style="danger")
        self.confirm_button.add_class("gpulab-stop-confirm")
        self.cancel_button = W.Button(description="Cancel")
        self.cancel_button.add_class("gpulab-stop-cancel")
        self.confirm_text = W.HTML("")
        self.confirm_box = W.HBox([self.confirm_text, self.confirm_button, self.cancel_button],
                                  layout=W.Layout(display="none"))
        self.confirm_box.add_class("gpulab-stop-confirmation")
        self.tb_toggle = W.ToggleButton(value=False, description="TensorBoard",
                                        icon="line-chart")
        self.tb_toggle.add_class("gpulab-tensorboard-toggle")
        self.tb_box = W.VBox([])
        self.message = W.HTML("")
        self.message.add_class("gpulab-message")

        self.stop_button.on_click(lambda _: self._ask_stop())
        self.cancel_button.on_click(lambda _: self._hide_confirm())
        self.confirm_button.on_click(lambda _: self._confirm_stop())
        self.tb_toggle.observe(lambda ch: self.show_tensorboard(ch["new"]), names="value")
        self.replica_choice.observe(lambda ch: self._choose_replica(ch["new"]), names="value")

        super().__init__([
            W.HBox([self.title, self.state]),
            self.replicas, self.restarts,
            self.progress_row,
            self.replica_choice, self.log_text,
            W.HBox([self.stop_button, self.tb_toggle]), self.confirm_box,
            self.message, self.tb_box,
        ])
        self.add_class("gpulab-jobview")
        if self.view:
            self._render(self.view)
        if tensorboard:
            self.tb_toggle.value = True
        if start:
            self.start()

    # -- callbacks ------------------------------------------------------------------------

    def on_stop(self, callback: Callable[[dict], None], remove: bool = False) -> None:
        self._cb._register("stop", callback, remove)

    def on_update(self, callback: Callable[[dict], None], remove: bool = False) -> None:
        self._cb._register("update", callback, remove)

    # -- reading the service ----------------------------------------------------------------

    def refresh(self) -> dict | None:
        """Read the job's status once and show it; the view, or None on an error (shown)."""
        try:
            view = self.job.status()
        except GpulabError as e:
            self._show_message("error", e.message)
            if e.status in (401, 403, 404):  # it will not get better by asking again
                self._stop_event.set()
            return None
        with self._lock:
            self.view = view
            self._render(view)
        if self.message.value and "gpulab-msg-error" in self.message.value:
            self._show_message("", "")  # a passing error (the service was away) is over
        self._cb._fire("update", view)
        return view

    def refresh_log(self) -> None:
        """Read the chosen replica's log on from where it was read last, and show its tail."""
        tail = self._tail
        if tail is None:
            return
        try:
            piece = self.job.read_log(tail.replica, tail.offset)
        except GpulabError as e:
            self._show_message("warning", f"Log of {tail.replica}: {e.message}")
            return
        if tail is self._tail and tail.feed(piece):
            self._show_log(tail.lines(self.log_lines))

    def start(self) -> None:
        """Watch the job in a background thread until it ends or the view is closed."""
        if self._thread and self._thread.is_alive():
            return
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._watch, name=f"gpulab-jobview-{self.job.name}",
                                        daemon=True)
        self._thread.start()

    def stop_watching(self) -> None:
        self._stop_event.set()

    def close(self):
        self._stop_event.set()
        super().close()

    def _watch(self) -> None:
        while not self._stop_event.is_set():
            view = self.refresh()
            if self._stop_event.wait(self.interval):
                return
            self.refresh_log()
            if jm.is_final(view):  # the log has been read once more after the end: done
                return
            if self._stop_event.wait(self.interval):
                return

    # -- showing --------------------------------------------------------------------------

    def _render(self, view: dict) -> None:
        state = view.get("state") or "?"
        self.state.value = (f"<span class='gpulab-state gpulab-state-{html.escape(state.lower())}'"
                            f" data-state='{html.escape(state)}'>"
                            f"{html.escape(jm.state_line(view))}</span>")
        why = jm.queue_reason(view)  # a queued job: why it waits, in words
        if why:
            self.state.value += f"<div class='gpulab-queue-reason'>{html.escape(why)}</div>"
        self.replicas.value = _replica_table(view)
        self.restarts.value = _restarts_html(view)
        known = jm.progress_of(view)
        if known:
            self.progress.value = known[2]
            self.progress.layout.display = "flex"
        self.progress_label.value = html.escape(jm.progress_text(view))
        self.progress_row.layout.display = "flex" if known or self.progress_label.value else "none"
        names = [r["replica"] for r in jm.replica_rows(view)]
        if list(self.replica_choice.options) != names:
            current = self.replica_choice.value
            self._set_choice(names=names, value=current if current in names else
                             (replica_to_show(view) if names else None))
        if jm.is_final(view):
            self.stop_button.disabled = True
            self.stop_button.layout.display = "none"  # nothing left to stop
            self._hide_confirm()
            failed = replica_to_show(view)
            if (not self._chosen_by_person and failed in names
                    and self.replica_choice.value != failed):
                self._set_choice(value=failed)  # the replica whose error ended the job

    _chosen_by_person = False

    def _set_choice(self, names=None, value=None) -> None:
        self._choosing = True
        try:
            if names is not None:
                self.replica_choice.options = names
            if value is not None:
                self.replica_choice.value = value
        finally:
            self._choosing = False

    def _choose_replica(self, replica: str | None) -> None:
        if not self._choosing:
            self._chosen_by_person = True
        if not replica or (self._tail and self._tail.replica == replica):
            return
        self._tail = jm.LogTail(replica)
        self._show_log("")
        if not (self._thread and self._thread.is_alive()):
            self.refresh_log()  # the watcher is done (the job ended): read it now

    def _show_log(self, text: str) -> None:
        self.log_plain = text
        self.log_text.value = _log_html(text)

    def _show_message(self, kind: str, text: str) -> None:
        self.message.value = _message(kind, text) if text else ""

    def show_tensorboard(self, show: bool = True) -> None:
        if show and not self.tb_box.children:
            self.tb_box.children = [TensorBoard(self.job.name, prefix=self._tb_prefix)]
        elif not show:
            self.tb_box.children = []
        if self.tb_toggle.value != show:
            self.tb_toggle.value = show

    # -- stop -----------------------------------------------------------------------------

    def _ask_stop(self) -> None:
        gpus = (self.view or {}).get("gpus")
        self.confirm_text.value = html.escape(jm.stop_question(self.job.name, gpus))
        self.confirm_box.layout.display = "flex"

    def _hide_confirm(self) -> None:
        self.confirm_box.layout.display = "none"

    def _confirm_stop(self) -> None:
        self._hide_confirm()
        self.stop_button.disabled = True
        self._show_message("info", f"Stopping {self.job.name}…")
        try:
            view = self.job.stop()
        except GpulabError as e:
            self.stop_button.disabled = False
            self._show_message("error", e.message)
            return
        with self._lock:
            self.view = view
            self._render(view)
        self._show_message("ok", f"Job {self.job.name} is {view.get('state')}.")
        self._cb._fire("stop", view)


def replica_to_show(view: Mapping) -> str:
    """The replica whose log a person wants first: in a failed job, the replica whose program
    failed (else the first that failed), otherwise the lead (chief, or worker 0)."""
    if (view.get("state") or "") == "Failed":
        failed = [r for r in view.get("replicas") or () if r.get("state") == "Failed"]
        raised = [r for r in failed if r.get("exit_code") in EXIT_NOT_RETRIED]
        if raised or failed:
            return (raised or failed)[0]["name"]
    return lead_replica(view)


def _restarts_html(view: Mapping) -> str:
    """A line per restart (`gpulab.extensions.joblog.restart_lines`), or nothing."""
    lines = restart_lines(view)
    if not lines:
        return ""
    return ("<div class='gpulab-restart-list' style='font-size:90%; color:var(--jp-warn-color0, "
            "#a60)'>" + "".join(f"<div class='gpulab-restart'>&#x21bb; {html.escape(ln)}</div>"
                                for ln in lines) + "</div>")


def _log_html(text: str) -> str:
    # a reversed flex column starts scrolled to its end: the newest lines show, with no
    # script. `flex:none` keeps the <pre> its full height: JupyterLab gives a <pre> its own
    # overflow, which would let it shrink to the box and leave the box showing the top
    return ("<div class='gpulab-log-scroll' style='height:14em; overflow:auto; display:flex; "
            "flex-direction:column-reverse; border:1px solid var(--jp-border-color2, #ccc); "
            "background:var(--jp-layout-color1, #fff)'><pre style='flex:none; margin:0; padding:4px; "
            "font-size:var(--jp-code-font-size, 12px); white-space:pre-wrap'>"
            f"{html.escape(text)}</pre></div>")


# -- TrainingLauncher -------------------------------------------------------------------


class TrainingLauncher(W.VBox):
    """A form that launches a distributed training job and then shows its `JobView`.

    Fields: name, strategy, parameter servers, workers, GPUs / CPUs / memory per worker,
    image (only when jobs run on Kubernetes), and the code: this cell (the cell that made the
    launcher, without the launcher's own lines), a function defined in the notebook, a
    ``.py`` file in your folder (``$GPULAB_USER_DIR``), or text (``code=``). Your quota and
    the hub's free GPUs are shown; Launch is disabled, with the reason, while the request
    cannot be admitted.

    Each launched job's `JobView` is added below the form (``job_view`` is the newest).
    Callbacks: ``on_launch(cb)``: ``cb(spec)`` before submitting (return False to cancel);
    ``on_submitted(cb)``: ``cb(job)`` with the submitted `Job`; ``on_error(cb)``:
    ``cb(error)`` with the `GpulabError` of a refusal.
    """

    def __init__(self, client: Client | None = None, *, name: str | None = None,
                 strategy: str = "parameter-server", ps: int = 1, workers: int = 2,
                 gpus: int = 0, cpu: float | None = None, memory: str | None = None,
                 image: str | None = None, code: str | None = None, cell: str | None = None,
                 namespace: dict | None = None, user_dir: str | None = None,
                 show_job: bool = True, quota_interval: float = 10.0, background: bool = True):
        import os

        self._cb = _Callbacks()
        #: set once the first look for the quota, the functions and the files is done; until
        #: then the form shows "loading…" and Launch waits (``background=False``: done
        #: before the constructor returns)
        self.loaded = threading.Event()
        #: seconds between reads of the quota while something may change it (0: never)
        self.quota_interval = quota_interval
        self._stop_event = threading.Event()
        self._quota_thread: threading.Thread | None = None
        self.client = client or Client()
        self.show_job = show_job
        self.me: dict | None = None
        self.job_view: JobView | None = None
        self.namespace = namespace if namespace is not None else _user_namespace()
        self.user_dir = user_dir if user_dir is not None else os.environ.get("GPULAB_USER_DIR")
        self.cell = cell if cell is not None else _current_cell()

        # one label width and one field width for every field: two tidy columns
        label, field = {"description_width": "7.5em"}, W.Layout(width="19em")
        self.name = W.Text(value=name or jm.unique_name(), description="Name", style=label,
                           layout=W.Layout(width="38.5em"))
        self.name.add_class("gpulab-name")
        self.strategy = W.Dropdown(options=list(jm.STRATEGIES), value=strategy,
                                   description="Strategy", style=label,
                                   layout=W.Layout(width="38.5em"))
        self.strategy.add_class("gpulab-strategy")
        self.ps = W.IntText(value=ps, description="PS", style=label, layout=field)
        self.ps.add_class("gpulab-ps")
        self.workers = W.IntText(value=workers, description="Workers", style=label,
                                 layout=field)
        self.workers.add_class("gpulab-workers")
        self.gpus = W.IntText(value=gpus, description="GPUs/worker", style=label,
                              layout=field)
        self.gpus.add_class("gpulab-gpus")
        self.cpu = W.Text(value="" if cpu is None else str(cpu), description="CPUs/worker",
                          placeholder="default", style=label, layout=field)
        self.cpu.add_class("gpulab-cpu")
        self.memory = W.Text(value=memory or "", description="Memory", placeholder="e.g. 8Gi",
                             style=label, layout=field)
        self.memory.add_class("gpulab-memory")
        self.image = W.Text(value=image or "", description="Image", placeholder="default",
                            style=label, layout=W.Layout(width="19em", display="none"))
        self.image.add_class("gpulab-image")

        sources = [("this cell", "cell"), ("a function", "function"), ("a file", "file"),
                   ("text", "text")]
        self.code_source = W.ToggleButtons(options=sources,
                                           value="text" if code is not None else "cell",
                                           description="Code", style=label)
        self.code_source.add_class("gpulab-code-source")
        self.function = W.Dropdown(options=[], description="Function", style=label,
                                   layout=W.Layout(width="38.5em"))
        self.function.add_class("gpulab-function")
        self.file = W.Dropdown(options=[], description="File", style=label,
                               layout=W.Layout(width="38.5em"))
        self.file.add_class("gpulab-file")
        self.code = W.Textarea(value=code or "", description="Program", style=label,
                               layout=W.Layout(width="100%", height="10em"))
        self.code.add_class("gpulab-code")
        # beside the function or file to choose (what it looks for again), with the quota
        self.rescan = W.Button(description="Rescan", icon="refresh",
                               tooltip="look again for functions and files, and the quota",
                               layout=W.Layout(width="auto"))
        self.rescan.add_class("gpulab-rescan")
        self.code_box = W.VBox([])

        self.quota = W.HTML("")
        self.quota.add_class("gpulab-quota")
        self.reason = W.HTML("")
        self.reason.add_class("gpulab-launch-reason")
        self.launch_button = W.Button(description="Launch", button_style="primary", icon="play")
        self.launch_button.add_class("gpulab-launch-button")
        self.message = W.HTML("")
        self.message.add_class("gpulab-message")
        self.output = W.VBox([])
        self.output.add_class("gpulab-launched")

        for w in (self.name, self.strategy, self.ps, self.workers, self.gpus, self.cpu,
                  self.memory, self.function, self.file, self.code):
            w.observe(lambda _: self.validate(), names="value")
        self.code_source.observe(lambda _: self._show_code_source(), names="value")
        self.strategy.observe(lambda _: self._show_strategy(), names="value")
        self.rescan.on_click(lambda _: self.scan())
        self.launch_button.on_click(lambda _: self.launch())

        super().__init__([
            W.HTML("<b>Distributed TensorFlow training</b>"),
            self.name, self.strategy,
            # two columns: how many, then what each worker gets
            W.HBox([self.workers, self.ps]),
            W.HBox([self.gpus, self.cpu]),
            W.HBox([self.memory, self.image]),
            self.code_source, self.code_box,
            self.quota,
            W.HBox([self.launch_button, self.reason]),
            self.message, self.output,
        ])
        self.add_class("gpulab-launcher")
        self._show_strategy()
        self._show_code_source()
        # the form is shown at once; what needs the service (the quota: a request that may
        # take up to `Client.timeout`) or the folder (its files) is read behind it
        if background:
            self.quota.value = _LOADING
            threading.Thread(target=self._first_scan, daemon=True,
                             name="gpulab-launcher-scan").start()
        else:
            self._first_scan()

    # -- callbacks ------------------------------------------------------------------------

    def on_launch(self, callback: Callable[[dict], bool | None], remove: bool = False) -> None:
        self._cb._register("launch", callback, remove)

    def on_submitted(self, callback: Callable[[Job], None], remove: bool = False) -> None:
        self._cb._register("submitted", callback, remove)

    def on_error(self, callback: Callable[[GpulabError], None], remove: bool = False) -> None:
        self._cb._register("error", callback, remove)

    # -- state ----------------------------------------------------------------------------

    def _first_scan(self) -> None:
        try:
            self.scan()
        except Exception as e:  # shown in the form, never lost in a thread
            self.message.value = _message("error", f"Could not read the quota or your "
                                          f"folder: {_error_text(e)}")
        finally:
            self.loaded.set()
            self.validate()

    def scan(self) -> None:
        """Look (again) for the notebook's functions, the folder's files and the quota."""
        fns = jm.notebook_functions(self.namespace or {})
        self._functions = fns
        _set_options(self.function, list(fns))
        _set_options(self.file, jm.python_files(self.user_dir))
        self.refresh_quota()
        self._watch_quota()

    def refresh_quota(self) -> None:
        """Read the quota and the holdings again, and check the form against them."""
        try:
            self.me = self.client.me()
        except GpulabError as e:
            self.me = None
            self.quota.value = _message("warning", f"Quota unknown: {e.message}")
        else:
            self.quota.value = _quota_html(self.me)
        self.image.layout.display = "flex" if jm.is_kubernetes(self.me) else "none"
        self.validate()

    def _quota_may_change(self) -> bool:
        """Whether the quota's picture can change by itself: a job or a held cluster of the
        person's holds GPUs (it will end), or the form is refused for the quota or the hub's
        free GPUs."""
        holdings = (self.me or {}).get("holdings") or ()
        return any(h.get("kind") in ("job", "cluster") for h in holdings) or (
            self.launch_button.disabled and "GPU" in self.reason.value)

    def _watch_quota(self) -> None:
        """Read the quota every `quota_interval` seconds while it may change by itself, so
        that Launch comes back when a job ends, without Rescan."""
        if not self.quota_interval or (self._quota_thread and self._quota_thread.is_alive()):
            return

        def watch():
            while not self._stop_event.wait(self.quota_interval):
                if self._quota_may_change():
                    self.refresh_quota()

        self._quota_thread = threading.Thread(target=watch, daemon=True,
                                              name="gpulab-launcher-quota")
        self._quota_thread.start()

    def close(self):
        self._stop_event.set()
        if self.job_view is not None:
            self.job_view.close()
        super().close()

    def _show_strategy(self) -> None:
        self.ps.layout.display = "flex" if self.strategy.value == "parameter-server" else "none"
        self.validate()

    def _show_code_source(self) -> None:
        kind = self.code_source.value
        self.code_box.children = {
            "cell": [W.HTML(f"<i>{html.escape(self._cell_note())}</i>")],
            "function": [W.HBox([self.function, self.rescan])],
            "file": [W.HBox([self.file, self.rescan])],
            "text": [self.code],
        }[kind]
        self.validate()

    def _cell_note(self) -> str:
        program = jm.cell_program(self.cell or "")
        n = len(program.splitlines())
        return (f"The code of this cell ({n} line{'s' if n != 1 else ''}, without the launcher)."
                if n else "This cell has no code besides the launcher.")

    def _number(self, text: str) -> float | None:
        text = (text or "").strip()
        if not text:
            return None
        return float(text)

    def form(self) -> tuple[dict, list[str]]:
        """(the spec the form describes, what stands in the way of launching it)."""
        problems: list[str] = []
        try:
            cpu = self._number(self.cpu.value)
        except ValueError:
            cpu = None
            problems.append(f"CPUs per worker '{self.cpu.value}' is not a number.")
        code, script = None, None
        kind = self.code_source.value
        try:
            if kind == "cell":
                code = jm.cell_program(self.cell or "")
            elif kind == "function":
                fn = self._functions.get(self.function.value)
                code = jm.function_program(fn) if fn else ""
                if not fn:
                    problems.append("Choose a function defined in this notebook.")
            elif kind == "file":
                script = self.file.value or None
                if not script:
                    problems.append("Choose a .py file in your folder.")
            else:
                code = self.code.value
        except ValueError as e:
            problems.append(str(e))
        fields = dict(name=self.name.value.strip(), strategy=self.strategy.value,
                      ps=self.ps.value, workers=self.workers.value, gpus=self.gpus.value,
                      cpu=cpu, memory=self.memory.value.strip() or None)
        problems += [p for p in jm.check_form(**fields, code=code, script=script)
                     if not (script is None and kind == "file" and "no code" in p)]
        spec = jm.build_spec(**fields, source=code if script is None else None, script=script,
                             image=(self.image.value.strip() or None)
                             if self.image.layout.display != "none" else None)
        if not problems:
            problems += jm.check_quota(jm.spec_gpus(spec), self.me)
        if not self.loaded.is_set():
            problems.insert(0, "Reading your quota and the free GPUs…")
        return spec, jm.check_available(self.me) + problems

    def validate(self) -> list[str]:
        """Check the form; disable Launch with the reason while it cannot be admitted."""
        if not hasattr(self, "launch_button"):
            return []
        _, problems = self.form()
        self.launch_button.disabled = bool(problems)
        self.reason.value = (_message("warning", " ".join(problems)) if problems else "")
        return problems

    def launch(self) -> Job | None:
        """Submit the job the form describes; show its `JobView` (or the service's refusal)."""
        spec, problems = self.form()
        if problems:
            self.validate()
            return None
        if any(result is False for result in self._cb._fire("launch", spec)):
            return None
        self.launch_button.disabled = True
        self.message.value = _message("info", f"Submitting {spec['name']}…")
        try:
            job = self.client.submit(spec)
        except GpulabError as e:
            self.message.value = _message("error", e.message)
            self._cb._fire("error", e)
            self.launch_button.disabled = False
            return None
        self.message.value = _message("ok", f"Job {job.name} submitted: {job.view['state']}.")
        if self.show_job:
            self.job_view = JobView(job, self.client)
            # its end frees its GPUs: the quota line and Launch follow at once
            self.job_view.on_update(lambda v: self.refresh_quota() if jm.is_final(v) else None)
            self.output.children = (*self.output.children, self.job_view)  # newest last
        self._cb._fire("submitted", job)
        self.name.value = jm.unique_name()  # names are used once; ready for the next launch
        self.scan()
        return job


# -- JobsList ---------------------------------------------------------------------------


class JobsList(W.VBox):
    """The person's jobs (newest first) with their state, GPUs and time, Open and Stop.

    Open shows the job's `JobView` below the list (``on_open(cb)``: ``cb(job_view)``); Stop
    asks for confirmation, then stops it (``on_stop(cb)``: ``cb(view_dict)``). Refresh reads
    the list again; ``interval`` (seconds, default 5, 0 for never) refreshes it while a job
    is active.
    """

    def __init__(self, client: Client | None = None, *, interval: float = 5.0,
                 start: bool = True):
        self._cb = _Callbacks()
        self.client = client or Client()
        self.interval = max(MIN_INTERVAL, interval) if interval else 0
        self.jobs: list[dict] = []
        self._pending_stop: str | None = None
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh_button = W.Button(description="Refresh", icon="refresh")
        self.refresh_button.add_class("gpulab-jobs-refresh")
        self.rows = W.VBox([])
        self.rows.add_class("gpulab-jobs-rows")
        self.message = W.HTML("")
        self.message.add_class("gpulab-message")
        self.detail = W.VBox([])
        self.detail.add_class("gpulab-jobs-detail")
        self.refresh_button.on_click(lambda _: self.refresh())
        super().__init__([W.HBox([W.HTML("<b>Your training jobs</b>"), self.refresh_button]),
                          self.rows, self.message, self.detail])
        self.add_class("gpulab-jobslist")
        self.refresh()
        if start and self.interval:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="gpulab-jobslist")
            self._thread.start()

    def on_open(self, callback: Callable[[JobView], None], remove: bool = False) -> None:
        self._cb._register("open", callback, remove)

    def on_stop(self, callback: Callable[[dict], None], remove: bool = False) -> None:
        self._cb._register("stop", callback, remove)

    def close(self):
        self._stop_event.set()
        super().close()

    def _watch(self) -> None:
        while not self._stop_event.wait(self.interval):
            if any(j.get("state") not in FINAL for j in self.jobs):
                self.refresh()

    def refresh(self) -> None:
        try:
            jobs = self.client.jobs()
        except GpulabError as e:
            self.message.value = _message("error", e.message)
            return
        self.message.value = "" if jobs else _message("info", "You have no training jobs yet.")
        if [(j["name"], j["state"]) for j in jobs] == [(j["name"], j["state"]) for j in self.jobs]:
            self.jobs = jobs
            return
        self.jobs = jobs
        self.rows.children = [self._row(j) for j in jobs]

    def _row(self, job: dict) -> W.Widget:
        name = job["name"]
        label = W.HTML(
            f"<span class='gpulab-job-name'>{html.escape(name)}</span> · "
            + ("<span class='gpulab-kind' data-kind='cluster'>cluster</span> · "
               if job.get("kind") == "cluster" else "") +
            f"<span class='gpulab-state gpulab-state-{html.escape(job['state'].lower())}' "
            f"data-state='{html.escape(job['state'])}'>{html.escape(jm.state_line(job))}</span>",
            layout=W.Layout(width="60%"))
        open_button = W.Button(description="Open", layout=W.Layout(width="auto"))
        open_button.add_class("gpulab-open")
        stop_button = W.Button(description="Stop", button_style="danger",
                               layout=W.Layout(width="auto",  # a finished job has no Stop
                                               display="none" if jm.is_final(job) else None),
                               disabled=jm.is_final(job))
        stop_button.add_class("gpulab-stop")
        confirm = W.Button(description=f"Yes, stop {name}", button_style="danger",
                           layout=W.Layout(width="auto", display="none"))
        confirm.add_class("gpulab-stop-confirm")
        open_button.on_click(lambda _: self.open_job(name))
        stop_button.on_click(lambda _: setattr(confirm.layout, "display", "flex"))
        confirm.on_click(lambda _: self.stop_job(name))
        row = W.HBox([label, open_button, stop_button, confirm])
        row.add_class("gpulab-job-row")
        return row

    def open_job(self, name: str) -> JobView:
        for child in self.detail.children:
            child.close()
        view = JobView(self.client.job(name), self.client)
        self.detail.children = [view]
        self._cb._fire("open", view)
        return view

    def stop_job(self, name: str) -> dict | None:
        try:
            view = self.client.job(name).stop()
        except GpulabError as e:
            self.message.value = _message("error", e.message)
            return None
        self.message.value = _message("ok", f"Job {name} is {view.get('state')}.")
        self._cb._fire("stop", view)
        self.refresh()
        return view


def _set_options(dropdown: W.Dropdown, options: list) -> None:
    current = dropdown.value
    dropdown.options = options
    if current in options:
        dropdown.value = current
    elif options:
        dropdown.value = options[0]


# -- notebook context -------------------------------------------------------------------


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _user_namespace() -> dict:
    ip = _ipython()
    return ip.user_ns if ip is not None else {}


def _current_cell() -> str:
    """The code of the cell being run (IPython stores it in ``In`` before running it)."""
    ip = _ipython()
    if ip is None:
        return ""
    inputs = ip.user_ns.get("In") or []
    return inputs[-1] if inputs else ""


__all__ = ["TrainingLauncher", "JobView", "JobsList", "TensorBoard", "GpulabError"]


# -- a cluster held for this kernel (issue 38) ----------------------------------------------


class ClusterLauncher(W.VBox):
    """A form with `gpulab.cluster`'s fields (name, parameter servers, workers, GPUs per
    worker): Hold asks for the cluster, and the status line shows its place while it waits
    in line, then that it is serving; ``cluster`` is then the `gpulab.extensions.cluster.
    Cluster` (``widget.cluster.strategy()`` in the next cell); Stop ends it. Callbacks:
    ``on_serving(cluster)``, ``on_error(message)``."""

    def __init__(self, client: Client | None = None, *, name: str = "", ps: int = 1,
                 workers: int = 2, gpus_per_worker: int = 0, interval: float = 1.0):
        from .cluster import cluster_spec

        self._spec_of = cluster_spec
        self.client = client or Client()
        self.interval = interval
        self.cluster = None
        self._cb = _Callbacks()
        self._stop_event = threading.Event()
        self.name = W.Text(value=name, description="Name",
                           placeholder="cluster-… (a name held already re-attaches)")
        self.ps = W.BoundedIntText(value=ps, min=1, max=64, description="Parameter servers")
        self.workers = W.BoundedIntText(value=workers, min=1, max=1024, description="Workers")
        self.gpus = W.BoundedIntText(value=gpus_per_worker, min=0, max=64,
                                     description="GPUs per worker")
        self.hold_button = W.Button(description="Hold", button_style="primary")
        self.stop_button = W.Button(description="Stop", button_style="danger",
                                    layout=W.Layout(display="none"))
        self.status = W.HTML("")
        for w, css in ((self.name, "gpulab-cluster-name"), (self.ps, "gpulab-cluster-ps"),
                       (self.workers, "gpulab-cluster-workers"),
                       (self.gpus, "gpulab-cluster-gpus"), (self.hold_button, "gpulab-hold"),
                       (self.stop_button, "gpulab-cluster-stop"),
                       (self.status, "gpulab-cluster-status")):
            w.add_class(css)
        self.hold_button.on_click(lambda _: self.hold())
        self.stop_button.on_click(lambda _: self.stop())
        super().__init__([self.name, self.ps, self.workers, self.gpus,
                          W.HBox([self.hold_button, self.stop_button]), self.status])
        self.add_class("gpulab-cluster-launcher")

    def on_serving(self, callback: Callable, remove: bool = False) -> None:
        self._cb._register("serving", callback, remove)

    def on_error(self, callback: Callable[[str], None], remove: bool = False) -> None:
        self._cb._register("error", callback, remove)

    def _show(self, kind: str, state: str, text: str) -> None:
        self.status.value = (f'<span data-state="{html.escape(state)}">'
                             f"{_message(kind, text)}</span>")

    def hold(self):
        """Ask for the cluster (or re-attach to the one of that name); it is watched from a
        thread until it serves. Returns the `Cluster`, or None when refused."""
        from .cluster import CLUSTER, Cluster

        self._stop_event.clear()
        name = self.name.value.strip()
        try:
            view = None
            if name:
                try:
                    view = self.client.request("GET", f"jobs/{name}")
                except GpulabError as e:
                    if e.status != 404:
                        raise
                if view is not None and (view.get("kind") != CLUSTER or view["state"] in FINAL):
                    raise GpulabError(f"'{name}' is taken by a job or an ended cluster of "
                                      "yours; choose another name.", 409, "name")
            if view is None:
                import secrets

                name = name or f"cluster-{secrets.token_hex(3)}"
                view = self.client.request("POST", "jobs", body=self._spec_of(
                    name=name, ps=self.ps.value, workers=self.workers.value,
                    gpus_per_worker=self.gpus.value))
            self.name.value = name
            self.cluster = Cluster(self.client, view)
            self.cluster._hold()
        except GpulabError as e:
            self._show("error", "Refused", e.message)
            self._cb._fire("error", e.message)
            return None
        self.hold_button.disabled = True
        self.stop_button.layout.display = "flex"
        threading.Thread(target=self._watch, daemon=True,
                         name=f"gpulab-cluster-widget-{name}").start()
        return self.cluster

    def _watch(self) -> None:
        from .cluster import _serving, waiting_words

        cluster = self.cluster
        while not self._stop_event.is_set():
            try:
                view = cluster.status()
            except GpulabError as e:
                self._show("error", "Error", e.message)
                return
            state = view["state"]
            if state in FINAL:
                self._show("warning", state, f"Cluster {cluster.name}: {state}: {view['reason']}")
                self.hold_button.disabled = False
                self.stop_button.layout.display = "none"
                return
            if state == "Queued":
                self._show("info", "Queued", waiting_words(view))
            else:
                addresses = [a for r in ("ps", "worker") for a in cluster.addresses.get(r, [])]
                up = [a for a in addresses if _serving(a)]
                if addresses and len(up) == len(addresses):
                    self._show("ok", "Serving", f"Cluster {cluster.name}: "
                               f"{len(cluster.addresses['ps'])} ps and "
                               f"{len(cluster.addresses['worker'])} workers serving "
                               f"({view['gpus']} GPU(s)). In a cell: strategy = "
                               "widget.cluster.strategy()")
                    self._cb._fire("serving", cluster)
                    return
                self._show("info", "Starting", f"Cluster {cluster.name}: starting, "
                           f"{len(up)} of {len(addresses)} servers up")
            self._stop_event.wait(self.interval)

    def stop(self) -> dict | None:
        """End the cluster; its GPUs come back."""
        self._stop_event.set()
        if self.cluster is None:
            return None
        try:
            view = self.cluster.stop()
        except GpulabError as e:
            self._show("error", "Error", e.message)
            return None
        self._show("info", view["state"], f"Cluster {self.cluster.name}: {view['state']}: "
                   f"{view['reason']}")
        self.hold_button.disabled = False
        self.stop_button.layout.display = "none"
        return view
