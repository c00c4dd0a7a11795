"""The notebook side of training jobs without a kernel: the job logic (gpulab.extensions.jobmodel),
the widgets over a dummy comm (as ipywidgets' own tests do), the cell magic's flags in a real
IPython shell, and the client's configuration from the environment.

The widgets talk to `tests.doubles.FakeClient`; the real client against a real gpulab service is
tested in tests/app/test_client.py.
"""

import re
import sys
import time

import comm
import ipywidgets
import pytest

from gpulab.extensions import jobmodel as jm
from gpulab.extensions import magics
from gpulab.extensions.client import Client, GpulabError, lead_replica, service_url_from_env
from tests.doubles import ME, FakeClient, job_view


class DummyComm:
    """ipywidgets/widgets/tests/utils.py's DummyComm: records what a widget would send."""

    comm_id = "a-b-c-d"
    kernel = "Truthy"

    def __init__(self, *args, **kwargs):
        self.messages = []

    def open(self, *args, **kwargs):
        pass

    def on_msg(self, *args, **kwargs):
        pass

    def send(self, *args, **kwargs):
        self.messages.append((args, kwargs))

    def close(self, *args, **kwargs):
        pass


@pytest.fixture(autouse=True)
def dummy_comm(monkeypatch):
    monkeypatch.setattr(comm, "create_comm", lambda **kw: DummyComm())
    monkeypatch.setattr(comm, "get_comm_manager", lambda **kw: {})
    yield
    ipywidgets.Widget.close_all()


def classes(widget):
    return set(widget._dom_classes)


# -- spec and admission -----------------------------------------------------------------------


def test_build_spec_parameter_server_and_multi_worker():
    assert jm.build_spec(name="digits", strategy="parameter-server", ps=1, workers=2, gpus=1,
                         cpu=2.0, memory="8Gi", source="print(1)\n", args=["--epochs", 3],
                         env={"A": "b"}, max_runtime=600, retries=1) == {
        "name": "digits", "strategy": "parameter-server",
        "replicas": {"chief": 1, "ps": 1, "worker": 2},
        "resources": {"worker": {"gpus": 1, "cpu": 2.0, "memory": "8Gi"}},
        "source": "print(1)\n", "args": ["--epochs", "3"], "env": {"A": "b"},
        "max_runtime": 600, "retries": 1}
    assert jm.build_spec(name="mw", strategy="multi-worker-mirrored", ps=3, workers=2,
                         script="train.py", image="tf:2.21") == {
        "name": "mw", "strategy": "multi-worker-mirrored", "replicas": {"worker": 2},
        "resources": {"worker": {"gpus": 0}}, "script": "train.py", "image": "tf:2.21"}
    assert jm.spec_gpus(jm.build_spec(name="x", ps=1, workers=3, gpus=2, source="x")) == 6


GOOD = dict(name="digits", strategy="parameter-server", ps=1, workers=2, gpus=1, code="print(1)")
FORM_CASES = [
    ("fine", {}, []),
    ("zero workers", {"workers": 0}, ["at least 1 worker"]),
    ("negative workers", {"workers": -2}, ["at least 1 worker"]),
    ("zero ps", {"ps": 0}, ["at least 1 parameter server"]),
    ("zero ps is fine for multi-worker", {"ps": 0, "strategy": "multi-worker-mirrored"}, []),
    ("negative gpus", {"gpus": -1}, ["cannot be negative"]),
    ("empty code", {"code": "  \n"}, ["no code to run"]),
    ("no code but a script", {"code": None, "script": "train.py"}, []),
    ("upper-case name", {"name": "Digits"}, ["lower-case letters"]),
    ("no name", {"name": ""}, ["Give the job a name"]),
    ("long name", {"name": "a" * 41}, ["at most 40"]),
    ("zero cpu", {"cpu": 0}, ["more than 0"]),
    ("bad memory", {"memory": "lots"}, ["not a size"]),
    ("bad strategy", {"strategy": "allreduce"}, ["must be one of"]),
]


@pytest.mark.parametrize("change,expected", [c[1:] for c in FORM_CASES],
                         ids=[c[0] for c in FORM_CASES])
def test_check_form(change, expected):
    problems = jm.check_form(**{**GOOD, **change})
    assert len(problems) == len(expected), problems
    for p, e in zip(problems, expected):
        assert e in p


QUOTA_CASES = [
    ("within quota and free", 3, ME, []),
    ("over the quota with what is held", 4, ME,
     ["needs 4 GPUs, but your quota is 4 at once and 1 is in use: notebook 'default' (1)."]),
    ("more than free", 6, {**ME, "quota": None, "gpus_held": 0}, ["only 5 of the hub's 8 are free"]),
    ("per request", 3, {**ME, "quota": {"max_gpus": 8, "max_per_request": 2}},
     ["at most 2 in one request"]),
    ("no gpus asked", 0, {**ME, "gpus_held": 4}, []),
    ("quota unknown", 99, None, []),
]


@pytest.mark.parametrize("requested,me,expected", [c[1:] for c in QUOTA_CASES],
                         ids=[c[0] for c in QUOTA_CASES])
def test_check_quota(requested, me, expected):
    problems = jm.check_quota(requested, me)
    assert len(problems) == len(expected), problems
    for p, e in zip(problems, expected):
        assert e in p


def test_quota_summary_and_backend():
    assert jm.quota_summary(ME) == ("Your quota: 4 GPUs at once; in use: 1; free on the hub: 5 "
                                    "of 8 GPUs (simulated).")
    unknown = {k: v for k, v in ME.items() if k != "jobs"}  # a service that does not say
    assert not jm.is_kubernetes(unknown, env={})
    assert jm.is_kubernetes(unknown, env={"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert jm.is_kubernetes({**ME, "jobs": {"backend": "kubernetes"}}, env={})
    assert not jm.is_kubernetes({**ME, "jobs": {"backend": "local"}},
                                env={"KUBERNETES_SERVICE_HOST": "10.0.0.1"})


# -- the program to run -----------------------------------------------------------------------


def test_cell_program_leaves_out_the_launcher():
    cell = ("from gpulab.extensions.widgets import TrainingLauncher\n"
            "import os\n"
            "def train():\n    print('hi')\n\n"
            "launcher = TrainingLauncher(\n    workers=2)\n"
            "train()\n")
    assert jm.cell_program(cell) == "import os\ndef train():\n    print('hi')\ntrain()\n"
    assert jm.cell_program("from gpulab.extensions.widgets import TrainingLauncher\n"
                           "TrainingLauncher()") == ""
    # not Python (a magic): line by line
    assert jm.cell_program("%matplotlib inline\nprint(1)\nTrainingLauncher()") == "print(1)\n"


def _train_here(x=3):
    print("trained", x)


def test_function_program_defines_and_calls(capsys):
    program = jm.function_program(_train_here)
    assert program.startswith("def _train_here(x=3):") and program.endswith("\n_train_here()\n")
    exec(compile(program, "job", "exec"), {})
    assert capsys.readouterr().out == "trained 3\n"
    with pytest.raises(ValueError, match="cannot be found"):
        jm.function_program(len)


def test_notebook_functions_and_python_files(tmp_path):
    ns = {"train": _train_here, "_hidden": _train_here, "x": 1, "len": len}
    _train_here.__module__ = "__main__"
    try:
        assert list(jm.notebook_functions(ns)) == ["train"]
    finally:
        _train_here.__module__ = __name__
    (tmp_path / "a.py").write_text("")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "sub" / "deep" / "deeper" / "deepest").mkdir(parents=True)
    (tmp_path / "sub" / "b.py").write_text("")
    (tmp_path / "sub" / "deep" / "deeper" / "deepest" / "far.py").write_text("")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "c.py").write_text("")
    (tmp_path / "jobs" / "old").mkdir(parents=True)
    (tmp_path / "jobs" / "old" / "source.py").write_text("")
    assert jm.python_files(tmp_path) == ["a.py", "sub/b.py"]
    assert jm.python_files(None) == [] and jm.python_files(tmp_path / "none") == []


# -- watching ---------------------------------------------------------------------------------


def test_elapsed_progress_and_state_line():
    view = job_view(progress={"step": 40, "total": 100, "epoch": 2, "loss": 0.123456,
                              "time": 5.0}, started_at=1000.0)
    assert jm.elapsed(view, now=1062.5) == 62.5
    assert jm.format_duration(62.5) == "1:02" and jm.format_duration(3725) == "1:02:05"
    assert jm.format_duration(None) == "–"
    assert jm.elapsed({**view, "finished_at": 1010.0}, now=5000) == 10.0
    assert jm.elapsed({**view, "started_at": None}) is None
    assert jm.progress_of(view) == (40, 100, 0.4)
    assert jm.progress_text(view) == "step 40 of 100 (40%) · epoch 2 · loss 0.1235"
    assert jm.progress_of({**view, "progress": {"step": 5, "total": None}}) is None
    assert jm.progress_text({**view, "progress": {"step": 5}}) == "step 5"
    assert jm.progress_of({**view, "progress": {"step": 500, "total": 100}}) == (100, 100, 1.0)
    assert jm.progress_of({**view, "progress": None}) is None
    assert jm.state_line(view, now=1062.5) == "Running · 2 GPUs · 1:02"
    failed = {**view, "state": "Failed", "reason": "chief-0 exited 1", "finished_at": 1190}
    assert jm.state_line(failed) == "Failed · chief-0 exited 1 · 2 GPUs · 3:10"
    rows = jm.replica_rows(view)
    assert [r["replica"] for r in rows] == ["chief-0", "ps-0", "worker-0", "worker-1"]
    assert rows[2] == {"replica": "worker-0", "state": "Running", "restarts": "0",
                       "exit code": "", "GPUs": "2", "GPU use": "", "reason": ""}
    # the service's words for how busy each GPU is, joined, while the replica runs
    busy = {**view, "replicas": [{**r, "usage": [
        {"device": 2, "measured": True, "text": "GPU 2: 37% busy, 1.0 of 80.0 GiB"},
        {"device": 3, "measured": False, "why": "not measured", "text": "GPU 3: usage not measured"}]}
        if r["name"] == "worker-0" else r for r in view["replicas"]]}
    assert jm.replica_rows(busy)[2]["GPU use"] == ("GPU 2: 37% busy, 1.0 of 80.0 GiB; "
                                                   "GPU 3: usage not measured")
    assert rows[0]["GPUs"] == "–"
    assert lead_replica(view) == "chief-0"
    assert lead_replica(job_view(strategy="multi-worker-mirrored")) == "worker-0"


def test_log_tail():
    tail = jm.LogTail("chief-0", max_chars=10)
    assert tail.feed({"text": "abc\n", "offset": 4, "size": 4, "done": False})
    assert tail.offset == 4 and tail.text == "abc\n"
    assert not tail.feed({"text": "", "offset": 4, "size": 4, "done": True}) and tail.done
    tail.feed({"text": "defghij\nklm\n", "offset": 16, "size": 16, "done": True})
    assert tail.text == "fghij\nklm\n" and tail.lines(1) == "klm"
    # a long log (more than one read): skip to its tail, then read on from there
    tail = jm.LogTail("chief-0", max_chars=10)
    assert tail.feed({"text": "x" * 8, "offset": 8, "size": 100, "done": False})
    assert tail.text == "" and tail.offset == 90
    assert tail.feed({"text": "0123456789", "offset": 100, "size": 100, "done": False})
    assert tail.text == "0123456789"
    # a log replaced by a shorter one is read again from its start
    assert tail.feed({"text": "", "offset": 100, "size": 3, "done": False})
    assert tail.offset == 0 and tail.text == ""


def test_tensorboard_url(monkeypatch):
    assert jm.tensorboard_url(prefix="/user/ann/") == "/user/ann/tensorboard/"
    assert jm.tensorboard_url("digits", prefix="/user/ann/") == \
        "/user/ann/tensorboard/?runFilter=%5Edigits%2F#timeseries"
    monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", "/user/bob/gpu/")
    assert jm.tensorboard_url() == "/user/bob/gpu/tensorboard/"


# -- the client's configuration ---------------------------------------------------------------

URL_CASES = [
    ("service url wins", {"GPULAB_SERVICE_URL": "http://hub:8002/services/gpulab",
                          "GPULAB_URL": "http://x"}, "http://hub:8002/services/gpulab/"),
    ("hub address as for the CLI", {"GPULAB_URL": "http://10.0.0.5:8000/",
                                    "JUPYTERHUB_PUBLIC_HUB_URL": "https://y/hub/"},
     "http://10.0.0.5:8000/services/gpulab/"),
    ("public hub url", {"JUPYTERHUB_PUBLIC_HUB_URL": "https://lab.example.org/hub/"},
     "https://lab.example.org/services/gpulab/"),
    ("empty public hub url", {"JUPYTERHUB_PUBLIC_HUB_URL": "",
                              "JUPYTERHUB_API_URL": "http://127.0.0.1:8081/hub/api"},
     "http://127.0.0.1:8000/services/gpulab/"),
]


@pytest.mark.parametrize("env,url", [c[1:] for c in URL_CASES], ids=[c[0] for c in URL_CASES])
def test_service_url_from_env(env, url):
    assert service_url_from_env(env) == url


def test_client_token_and_no_token(monkeypatch):
    monkeypatch.delenv("GPULAB_TOKEN", raising=False)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "server-token")
    monkeypatch.setenv("GPULAB_URL", "http://127.0.0.1:1")
    c = Client()
    assert c.token == "server-token" and c.url == "http://127.0.0.1:1/services/gpulab/"
    assert "server-token" not in repr(c)
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN")
    with pytest.raises(GpulabError, match="No hub API token"):
        Client().me()
    with pytest.raises(GpulabError, match="cannot be reached") as e:
        Client(token="t").me()
    assert e.value.status is None
    assert Client(hub_url="http://h:1", token="t").url == "http://h:1/services/gpulab/"


# -- TrainingLauncher ---------------------------------------------------------------------------


def launcher(client=None, **kw):
    from gpulab.extensions.widgets import TrainingLauncher

    kw.setdefault("namespace", {})
    kw.setdefault("user_dir", None)
    kw.setdefault("cell", "")
    kw.setdefault("background", False)  # the quota read before it returns (see below)
    return TrainingLauncher(client or FakeClient(), show_job=kw.pop("show_job", False), **kw)


def test_launcher_appears_before_the_quota_is_read():
    """Issue 37: the form is there at once, saying it is loading, while the quota is read
    behind it (the request may take up to Client.timeout, 30 s); Launch waits for it."""
    import threading

    class SlowClient(FakeClient):
        def __init__(self):
            super().__init__()
            self.answer = threading.Event()

        def me(self):
            assert self.answer.wait(10)
            return super().me()

    client = SlowClient()
    started = time.monotonic()
    w = launcher(client, code="print('train')", background=True)
    assert time.monotonic() - started < 1
    assert not w.loaded.is_set()
    assert "gpulab-loading" in w.quota.value and "loading" in w.quota.value
    assert w.launch_button.disabled and "Reading your quota" in w.reason.value
    client.answer.set()
    assert w.loaded.wait(10)
    assert "4 GPUs at once" in w.quota.value
    assert not w.launch_button.disabled and w.reason.value == ""


def test_launcher_shows_simulated_gpus_with_the_pill():
    w = launcher(code="x")
    assert "class='gpulab-simulated'" in w.quota.value and ">Simulated</span>" in w.quota.value
    assert "(simulated)" not in w.quota.value


def test_launcher_disables_launch_with_the_reason():
    w = launcher(code="print('train')", name="digits", workers=2, gpus=1)
    assert "gpulab-launcher" in classes(w)
    assert "gpulab-launch-button" in classes(w.launch_button)
    assert not w.launch_button.disabled and w.reason.value == ""
    assert "4 GPUs at once" in w.quota.value and "free on the hub: 5 of 8" in w.quota.value
    w.workers.value = 0
    assert w.launch_button.disabled and "at least 1 worker" in w.reason.value
    w.workers.value = -3
    assert w.launch_button.disabled
    w.workers.value = 2
    w.gpus.value = 2  # 4 GPUs, 1 already held by the notebook, quota 4
    assert w.launch_button.disabled
    assert "your quota is 4 at once and 1 is in use: notebook &#x27;default&#x27;" in w.reason.value
    w.gpus.value = 1
    w.code.value = "   "
    assert w.launch_button.disabled and "no code to run" in w.reason.value
    w.code.value = "print(2)"
    w.cpu.value = "two"
    assert w.launch_button.disabled and "not a number" in w.reason.value
    w.cpu.value = "1.5"
    assert not w.launch_button.disabled


def test_launcher_says_why_the_hub_runs_no_training():
    """Issue 14: where the runtime cannot import TensorFlow the service says so in ``me``;
    the launcher shows that reason and keeps Launch disabled."""
    import copy

    from tests.doubles import ME

    me = copy.deepcopy(ME)
    me["jobs"].update(available=False, reason="Training is off on this hub: TensorFlow "
                      "cannot be imported by its Python for training (/usr/bin/python3).")
    w = launcher(FakeClient(me=me), code="print('train')", name="digits", workers=1, gpus=0)
    assert w.launch_button.disabled
    assert "TensorFlow cannot be imported" in w.reason.value
    assert w.launch() is None
    me["jobs"] = None
    w = launcher(FakeClient(me=me), code="print('train')", name="digits", workers=1, gpus=0)
    assert w.launch_button.disabled and "not set up on this hub" in w.reason.value


def test_launcher_follows_the_quota_by_itself_when_a_job_ends():
    """Issue 14: Launch comes back when the job that held the GPUs ends, without Rescan."""
    import copy

    from tests.doubles import ME

    busy = copy.deepcopy(ME)
    busy.update(gpus_held=4, holdings=[{"kind": "job", "name": "old", "gpus": 3},
                                       {"kind": "notebook", "name": "default", "gpus": 1}])
    client = FakeClient(me=busy)
    w = launcher(client, code="print(1)", name="next", workers=1, gpus=1, quota_interval=0.2)
    try:
        assert w.launch_button.disabled and "job &#x27;old&#x27; (3)" in w.reason.value
        client._me = copy.deepcopy(ME)  # the job ended: only the notebook holds a GPU
        deadline = time.monotonic() + 10
        while w.launch_button.disabled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not w.launch_button.disabled and w.reason.value == ""
        assert "in use: 1" in w.quota.value
        calls = len([c for c in client.calls if c[1] == "me"])
        time.sleep(0.6)  # nothing can change by itself now: no more reads
        assert len([c for c in client.calls if c[1] == "me"]) == calls
    finally:
        w.close()
    w._quota_thread.join(2)
    assert not w._quota_thread.is_alive(), "close ends the quota watcher"


def test_launcher_submits_and_reports(capsys):
    client = FakeClient()
    w = launcher(client, code="print('train')", name="digits", workers=2, gpus=1, cpu=2,
                 memory="4Gi", show_job=True)
    seen = {}
    w.on_launch(lambda spec: seen.setdefault("spec", spec))
    w.on_submitted(lambda job: seen.setdefault("job", job))
    job = w.launch()
    assert job.name == "digits" and seen["job"] is job
    assert client.submitted == [seen["spec"]] == [{
        "name": "digits", "strategy": "parameter-server",
        "replicas": {"chief": 1, "ps": 1, "worker": 2},
        "resources": {"worker": {"gpus": 1, "cpu": 2.0, "memory": "4Gi"}},
        "source": "print('train')"}]
    assert "submitted" in w.message.value
    view = w.output.children[0]
    assert "gpulab-jobview" in classes(view)
    view.stop_watching()
    assert w.name.value != "digits"  # a fresh name for the next launch
    # a second launch adds its view below the first
    second = w.launch()
    assert second.name != "digits" and len(w.output.children) == 2
    assert w.output.children[1] is w.job_view and w.job_view.job is second
    w.job_view.stop_watching()
    # on_launch may cancel
    w.on_launch(lambda spec: False)
    assert w.launch() is None and len(client.submitted) == 2


def test_launcher_shows_a_refusal_as_a_message_not_a_traceback():
    refusal = GpulabError("Job 'digits' was not started: 2 of your 2 GPUs are in use: "
                          "notebook 'default' (2).", 403, "resources")
    client = FakeClient(refuse_submit=refusal)
    w = launcher(client, code="print(1)", name="digits")
    errors = []
    w.on_error(errors.append)
    assert w.launch() is None
    assert errors == [refusal]
    assert "gpulab-msg-error" in w.message.value and "2 of your 2 GPUs" in w.message.value
    assert not w.launch_button.disabled
    # the quota cannot be read: a warning, and the service decides at launch
    w2 = launcher(FakeClient(refuse_me=GpulabError("This token lacks the scope x.", 403)),
                  code="print(1)", gpus=100)
    assert "Quota unknown: This token lacks the scope x." in w2.quota.value
    assert not w2.launch_button.disabled


def test_launcher_code_sources(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("print(1)\n")
    _train_here.__module__ = "__main__"
    try:
        w = launcher(namespace={"train": _train_here}, user_dir=str(tmp_path),
                     cell="import os\nTrainingLauncher()\n", name="digits")
    finally:
        _train_here.__module__ = __name__
    assert w.code_source.value == "cell"
    spec, problems = w.form()
    assert problems == [] and spec["source"] == "import os\n"
    w.code_source.value = "function"
    spec, problems = w.form()
    assert problems == [] and spec["source"].endswith("_train_here()\n")
    assert w.function.options == ("train",)
    w.code_source.value = "file"
    spec, problems = w.form()
    assert problems == [] and spec["script"] == "train.py" and "source" not in spec
    w.code_source.value = "text"
    assert w.launch_button.disabled and "no code to run" in w.reason.value
    empty = launcher(cell="TrainingLauncher()")
    assert empty.launch_button.disabled and "no code to run" in empty.reason.value


def test_launcher_image_only_on_kubernetes(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert launcher(code="x").image.layout.display == "none"
    kube = launcher(FakeClient(me={**ME, "jobs": {"backend": "kubernetes"}}), code="x",
                    image="tf:2.21")
    assert kube.image.layout.display == "flex"
    assert kube.form()[0]["image"] == "tf:2.21"
    assert "image" not in launcher(code="x", image="tf:2.21").form()[0]


# -- JobView ----------------------------------------------------------------------------------


def test_jobview_renders_replicas_progress_and_log_tail():
    from gpulab.extensions.widgets import JobView

    client = FakeClient(jobs={"digits": (
        [job_view(progress={"step": 30, "total": 120, "loss": 0.5})],
        {"chief-0": "".join(f"line {i}\n" for i in range(100)), "worker-1": "w1 hello\n"})})
    view = JobView("digits", client, start=False, log_lines=5)
    assert "gpulab-jobview" in classes(view) and "gpulab-job-state" in classes(view.state)
    assert view.refresh()["state"] == "Running"
    assert "data-state='Running'" in view.state.value
    assert view.replicas.value.count("class='gpulab-replica'") == 4
    assert "data-replica='worker-1' data-state='Running'" in view.replicas.value
    assert view.progress.value == 0.25 and view.progress.layout.display == "flex"
    assert view.progress_row.layout.display == "flex"
    assert "step 30 of 120 (25%)" in view.progress_label.value
    assert view.replica_choice.options == ("chief-0", "ps-0", "worker-0", "worker-1")
    assert view.replica_choice.value == "chief-0"
    view.refresh_log()
    assert view.log_plain == "\n".join(f"line {i}" for i in range(95, 100))
    view.replica_choice.value = "worker-1"  # nothing watches (start=False): read at once
    assert view.log_plain == "w1 hello"
    assert "w1 hello" in view.log_text.value and "column-reverse" in view.log_text.value


def test_jobview_shows_a_keras_bar_as_one_clean_line_and_each_restart():
    """Issue 34: a Keras progress bar (\\b and \\r redraws) is one line in its last state,
    also while a redraw is split across reads; each restart of a replica is a line that says
    which, when and why."""
    from gpulab.extensions.joblog import restart_record
    from gpulab.extensions.widgets import JobView
    from tests.unit.test_joblog import AT, KERAS_LOG, KERAS_SHOWN

    running = job_view(strategy="multi-worker-mirrored")
    running["replicas"][0].update(restarts=1, restart_history=[restart_record(
        restart=1, at=AT, exit_code=-9, reason="killed by SIGKILL")])
    running["replicas"][1].update(restarts=1, restart_history=[restart_record(
        restart=1, at=AT, exit_code=None, reason="stopped to restart with worker-0")])
    cut = KERAS_LOG.rindex("\r3/4") + 20  # mid-redraw of the second epoch's bar
    client = FakeClient(jobs={"digits": ([running], {"worker-0": KERAS_LOG[:cut]})})
    view = JobView("digits", client, start=False, log_lines=10)
    view.refresh()
    assert [ln.split(": ", 1)[0] for ln in view.restarts.value.split("&#x21bb; ")[1:]] == [
        "worker-0", "worker-1"]
    assert ("worker-0: restart 1 at 14:05:31 (attempt 2): killed by SIGKILL (exit -9)"
            in view.restarts.value)
    assert "stopped to restart with worker-0" in view.restarts.value
    view.refresh_log()
    # the bar as a terminal shows it mid-redraw: the new one over the old, once
    assert view.log_plain.splitlines()[-1] == (
        "3/4 [==============>...............] - ETA: 0s - loss: 0.7290 - accuracy: 0.4062")
    assert view.log_plain.count("/4 [") == 2  # epoch 1's last state, and this one
    client.job("digits")._logs["worker-0"] = KERAS_LOG  # the program writes on
    view.refresh_log()
    assert view.log_plain == KERAS_SHOWN.rstrip("\n")
    assert "\b" not in view.log_text.value and "&#x27;" not in view.log_plain
    # no restart: nothing shown
    quiet = JobView("digits", FakeClient(), start=False)
    quiet.refresh()
    assert quiet.restarts.value == ""


def test_a_job_without_tensorboard_logs_says_how_to_write_them(tmp_path):
    from gpulab.extensions.widgets import TensorBoard

    (tmp_path / "jobs" / "quiet" / "tensorboard").mkdir(parents=True)
    tb = TensorBoard("quiet", prefix="/user/ann/", user_dir=str(tmp_path))
    assert "has written no TensorBoard logs" in tb.note.value
    assert "runtime.logdir()" in tb.note.value and "gpulab-tensorboard-note" in classes(tb.note)
    run = tmp_path / "jobs" / "loud" / "tensorboard" / "train"
    run.mkdir(parents=True)
    (run / "events.out.tfevents.1.host.v2").write_bytes(b"")
    assert TensorBoard("loud", prefix="/user/ann/", user_dir=str(tmp_path)).note.value == ""
    # all runs, or a folder not to be seen from here: nothing to say
    assert TensorBoard(prefix="/user/ann/", user_dir=str(tmp_path)).note.value == ""
    assert TensorBoard("gone", prefix="/user/ann/", user_dir=str(tmp_path)).note.value == ""


def test_jobview_of_a_failed_job_opens_the_failed_replicas_log():
    """Issue 14: the replica whose program failed is shown first (not the chief waiting for
    its peers), progress lines are not log text, every replica's log can still be read after
    the end, and there is no Stop on a finished job."""
    from gpulab.extensions.widgets import JobView

    failed = job_view(state="Failed", reason="the chief failed")
    for r in failed["replicas"]:
        r["state"] = "Stopped"
    failed["replicas"][3].update(state="Failed", exit_code=1)  # worker-1
    client = FakeClient(jobs={"digits": ([failed], {
        "chief-0": "waiting for ps-0, worker-0\n",
        "worker-1": 'GPULAB_PROGRESS {"step": 3}\nTraceback (most recent call last):\n'
                    "ValueError: bad input\n",
        "ps-0": "serving\n"})})
    view = JobView("digits", client, start=False)
    view.refresh()
    assert view.replica_choice.value == "worker-1"
    assert view.log_plain == "Traceback (most recent call last):\nValueError: bad input"
    assert view.stop_button.layout.display == "none" and view.stop_button.disabled
    view.replica_choice.value = "ps-0"
    assert view.log_plain == "serving"
    view.refresh()  # the person's choice stays
    assert view.replica_choice.value == "ps-0"


def test_jobview_has_no_progress_band_without_progress():
    """An ended job that reported no progress shows no empty band above "Log of"."""
    from gpulab.extensions.widgets import JobView

    client = FakeClient(jobs={"digits": ([job_view(state="Succeeded")], {})})
    view = JobView("digits", client, start=False)
    view.refresh()
    assert view.progress_row.layout.display == "none"
    assert view.progress_row in view.children


@pytest.mark.parametrize("gpus,words", [
    (0, "Stop job j? Every replica ends."),
    (None, "Stop job j? Every replica ends."),
    (1, "Stop job j? Every replica ends and its GPU is released."),
    (2, "Stop job j? Every replica ends and its 2 GPUs are released."),
], ids=["none", "unknown", "one", "two"])
def test_stop_question_counts_gpus_in_words(gpus, words):
    assert jm.stop_question("j", gpus) == words


def test_jobview_stop_asks_first():
    from gpulab.extensions.widgets import JobView

    client = FakeClient(jobs={"digits": ([job_view()], {})})
    view = JobView("digits", client, start=False)
    view.refresh()
    stopped = []
    view.on_stop(stopped.append)
    assert {"gpulab-stop"} <= classes(view.stop_button)
    assert "gpulab-stop-confirm" in classes(view.confirm_button)
    view.stop_button.click()
    assert view.confirm_box.layout.display == "flex" and "and its 2 GPUs are released." in \
        view.confirm_text.value
    assert not [c for c in client.calls if c[1] == "stop"]
    view.cancel_button.click()
    assert view.confirm_box.layout.display == "none"
    view.stop_button.click()
    view.confirm_button.click()
    assert [c[1] for c in client.calls].count("stop") == 1
    assert stopped and stopped[0]["state"] == "Stopped"
    assert "data-state='Stopped'" in view.state.value and view.stop_button.disabled
    assert "gpulab-msg-ok" in view.message.value


def test_jobview_shows_a_failed_stop_as_a_message():
    from gpulab.extensions.widgets import JobView

    client = FakeClient(jobs={"digits": ([job_view()], {})},
                        refuse_stop=GpulabError("You may only see and act on your own jobs.", 403))
    view = JobView("digits", client, start=False)
    view.stop_button.click()
    view.confirm_button.click()
    assert "act on your own jobs" in view.message.value and not view.stop_button.disabled


def test_jobview_tensorboard_toggle():
    from gpulab.extensions.widgets import JobView

    view = JobView("digits", FakeClient(), start=False, tensorboard_prefix="/user/ann/")
    assert view.tb_box.children == ()
    view.tb_toggle.value = True
    (tb,) = view.tb_box.children
    assert "gpulab-tensorboard" in classes(tb)
    assert 'src="/user/ann/tensorboard/?runFilter=%5Edigits%2F#timeseries"' in tb.frame.value
    assert "runs of job <b>digits</b>" in tb.caption.value
    view.tb_toggle.value = False
    assert view.tb_box.children == ()


def test_jobview_watches_live_at_most_once_a_second_and_ends_with_the_job():
    from gpulab.extensions.widgets import JobView

    views = [job_view(state="Running"), job_view(state="Succeeded", finished_at=1100.0)]
    client = FakeClient(jobs={"digits": (views, {"chief-0": "done\n"})})
    updates = []
    t0 = time.monotonic()
    view = JobView("digits", client, interval=0.1)  # asks for less than a second: clamped
    view.on_update(lambda v: updates.append(v["state"]))
    view._thread.join(timeout=20)
    assert not view._thread.is_alive(), "the watcher stops once the job has ended"
    assert time.monotonic() - t0 >= 2.9
    times = [c[0] for c in client.calls]
    assert all(b - a >= 0.95 for a, b in zip(times, times[1:])), times
    assert "data-state='Succeeded'" in view.state.value and "done" in view.log_plain
    assert updates[-1] == "Succeeded"


def test_jobview_says_where_a_queued_job_stands_and_why():
    from gpulab.extensions.widgets import JobView

    why = ("Waits for your quota: 2 of your 2 GPUs are in use by your job 'sleeper' (1 GPU, "
           "its time limit ends in about 5 min) & your notebook 'default'.")
    queued = {**job_view(state="Queued", started_at=None, gpus=1), "replicas": [],
              "queue": {"position": 1, "estimated_start": time.time() + 300, "reason": why}}
    ran = job_view(state="Running", gpus=1)
    client = FakeClient(jobs={"digits": ([queued, ran], {})})
    view = JobView("digits", client, start=False)
    assert view.refresh()["state"] == "Queued"
    assert "data-state='Queued'" in view.state.value
    assert re.search(r"Queued · next in line · starts in about [45] min \(\d\d:\d\d\)",
                     view.state.value), view.state.value
    assert ("<div class='gpulab-queue-reason'>Waits for your quota: 2 of your 2 GPUs are in use "
            "by your job &#x27;sleeper&#x27; (1 GPU, its time limit ends in about 5 min) &amp; "
            "your notebook &#x27;default&#x27;.</div>") in view.state.value
    assert view.refresh()["state"] == "Running"
    assert "gpulab-queue-reason" not in view.state.value  # it no longer waits


def test_jobview_stops_watching_a_job_it_may_not_see():
    from gpulab.extensions.widgets import JobView

    class Missing(FakeClient):
        def job(self, name):
            job = super().job(name)
            job.status = lambda: (_ for _ in ()).throw(
                GpulabError(f"You have no job named '{name}'.", 404))
            return job

    view = JobView("nope", Missing())
    view._thread.join(timeout=5)
    assert not view._thread.is_alive()
    assert "You have no job named &#x27;nope&#x27;." in view.message.value


def test_jobview_close_ends_the_watcher():
    from gpulab.extensions.widgets import JobView

    view = JobView("digits", FakeClient())
    view.close()
    view._thread.join(timeout=5)
    assert not view._thread.is_alive()


# -- JobsList and TensorBoard -------------------------------------------------------------------


def test_jobslist_open_and_stop():
    from gpulab.extensions.widgets import JobsList

    client = FakeClient(jobs={"digits": ([job_view()], {}),
                              "old": ([job_view("old", "Succeeded", finished_at=1010.0)], {})})
    w = JobsList(client, start=False)
    assert "gpulab-jobslist" in classes(w) and len(w.rows.children) == 2
    row = w.rows.children[0]
    label, open_b, stop_b, confirm = row.children
    assert "data-state='Running'" in label.value and not stop_b.disabled
    ended_stop = w.rows.children[1].children[2]  # an ended job has no Stop
    assert ended_stop.disabled and ended_stop.layout.display == "none"
    opened = []
    w.on_open(opened.append)
    open_b.click()
    assert opened and opened[0].job.name == "digits" and w.detail.children == (opened[0],)
    opened[0].stop_watching()
    stop_b.click()
    assert confirm.layout.display == "flex" and not [c for c in client.calls if c[1] == "stop"]
    confirm.click()
    assert [c[1] for c in client.calls].count("stop") == 1
    assert "data-state='Stopped'" in w.rows.children[0].children[0].value
    assert JobsList(FakeClient(), start=False).message.value.count("no training jobs") == 1


def test_tensorboard_widget_for_all_runs():
    from gpulab.extensions.widgets import TensorBoard

    tb = TensorBoard(prefix="/user/ann/", height=300)
    assert tb.url == "/user/ann/tensorboard/"
    assert 'src="/user/ann/tensorboard/"' in tb.frame.value and "height:300px" in tb.frame.value
    assert "all your runs" in tb.caption.value


def test_widgets_module_keeps_ipywidgets_out_of_the_job_logic():
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", "import sys, gpulab.extensions.client, gpulab.extensions.jobmodel, "
         "gpulab.extensions.magics; print('ipywidgets' in sys.modules, 'tornado' in sys.modules)"],
        capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# -- the cell magic ---------------------------------------------------------------------------

BAD_LINES = [
    ("zero workers", "--workers 0", "at least 1 worker"),
    ("negative gpus", "--gpus -1", "cannot be negative"),
    ("not a number", "--ps one", "argument --ps: invalid int value: 'one'"),
    ("unknown flag", "--epochs 3", "unrecognized arguments: --epochs"),
    ("abbreviated flag", "--work 2", "unrecognized arguments"),
    ("bad strategy", "--strategy allreduce", "invalid choice: 'allreduce'"),
    ("bad name", "--name Digits", "lower-case letters"),
    ("bad env", "--env NOVALUE", "--env takes NAME=VALUE"),
    ("bad quoting", "--name 'x", "cannot read the flags"),
    ("negative max runtime", "--max-runtime -5", "--max-runtime must be a positive"),
]


@pytest.mark.parametrize("line,message", [c[1:] for c in BAD_LINES], ids=[c[0] for c in BAD_LINES])
def test_magic_bad_flags(line, message):
    with pytest.raises(magics.ArgError, match="^%%gpulab_train: ") as e:
        magics.parse_train_line(line, "print(1)")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_magic_flags_make_the_spec():
    spec, ns = magics.parse_train_line(
        "--name digits --strategy parameter-server --ps 1 --workers 2 --gpus 1 --cpu 2 "
        "--memory 8Gi --max-runtime 600 --retries 1 --env A=b=c -- --epochs 3", "print(1)\n")
    assert spec == {"name": "digits", "strategy": "parameter-server",
                    "replicas": {"chief": 1, "ps": 1, "worker": 2},
                    "resources": {"worker": {"gpus": 1, "cpu": 2.0, "memory": "8Gi"}},
                    "source": "print(1)\n", "args": ["--epochs", "3"], "env": {"A": "b=c"},
                    "max_runtime": 600, "retries": 1}
    spec, _ = magics.parse_train_line("--strategy multi-worker-mirrored --workers 3", "x = 1")
    assert spec["replicas"] == {"worker": 3} and jm.NAME_RE.match(spec["name"])
    assert spec["name"].startswith("nb-")
    with pytest.raises(magics.ArgError, match="no code to run"):
        magics.parse_train_line("", "\n  \n")


def test_magic_in_a_real_shell_prints_one_line(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "gpulab.extensions")
    shell.run_cell_magic("gpulab_train", "--workers 0", "print(1)\n")
    err = capsys.readouterr().err
    assert err.strip() == "%%gpulab_train: A job needs at least 1 worker."
    shell.run_cell_magic("gpulab_train", "--help", "pass\n")
    assert "--workers" in capsys.readouterr().out
    # a refusal of the service is one line too
    client = FakeClient(refuse_submit=GpulabError("name: you already have a job named 'a'.",
                                                  409, "name"))
    assert magics.gpulab_train("--name a", "print(1)", client=client) is None
    assert capsys.readouterr().err == "gpulab: name: you already have a job named 'a'.\n"
    client = FakeClient()
    magics.gpulab_train("--name b --workers 2 --no-view", "print(1)", client=client, shell=shell)
    assert shell.user_ns["_gpulab_job"].name == "b"
    assert capsys.readouterr().out == "gpulab: job b submitted: Starting\n"


QUEUE_ROWS = [
    ({"position": 1, "estimated_start": 1000.0}, 990.0, "next in line · starts in a moment"),
    ({"position": 2, "estimated_start": 1720.0}, 1000.0, "2nd in line · starts in about 12 min"),
    ({"position": 3, "estimated_start": None}, 1000.0, "3rd in line · start unknown"),
    ({"position": 11, "estimated_start": 1000.0 + 3 * 3600}, 1000.0,
     "11th in line · starts in about 3.0 h"),
    ({"position": 22, "estimated_start": None}, 1000.0, "22nd in line · start unknown"),
    ({"position": None, "estimated_start": None}, 1000.0, "held by an admin"),
    # the queue's reason says why the start is unknown: the state line says it short
    ({"position": 1, "estimated_start": None,
      "reason": "Waits for 2 GPUs at once: 0 of 2 are free now (start unknown: a notebook "
                "using them has no time limit: a notebook ends when its person stops it)."},
     1000.0, "next in line · start unknown: a notebook using them has no time limit"),
    ({"position": 2, "estimated_start": None,
      "reason": "Waits for your quota: 2 of your 2 GPUs are in use by your notebook 'nb' (2 "
                "GPUs, no time limit: stop it to free them); it starts when enough of your "
                "own work ends (start unknown: your own work holding it has no time limit)."},
     1000.0, "2nd in line · start unknown: your own work holding it has no time limit"),
]


@pytest.mark.parametrize("queue,now,expected", QUEUE_ROWS)
def test_a_queued_jobs_place_in_words(queue, now, expected):
    from gpulab.extensions import jobmodel

    text = jobmodel.queue_text({"state": "Queued", "queue": queue}, now)
    assert text.startswith(expected)
    if "reason" in queue:
        assert text == expected
    line = jobmodel.state_line({"state": "Queued", "gpus": 2, "queue": queue,
                                "reason": "Waits for 2 GPUs at once"}, now)
    assert line.startswith(f"Queued · {expected}") and "2 GPUs" in line
    assert "Waits for" not in line  # the reason is shown apart, it is long
    assert jobmodel.queue_text({"state": "Running"}, now) == ""
