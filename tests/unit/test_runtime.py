"""The training runtime's TensorFlow-free parts: configuration, exit codes, paths, progress.

Real TensorFlow replicas are tested in tests/tf/test_runtime_processes.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpulab.extensions import runtime as rt

PS_CLUSTER = {"chief": ["127.0.0.1:2000"], "ps": ["127.0.0.1:2001"],
              "worker": ["127.0.0.1:2002", "127.0.0.1:2003"]}
MW_CLUSTER = {"worker": ["127.0.0.1:2010", "127.0.0.1:2011"]}


def env_of(cluster, task_type, index=0, strategy="parameter-server", **extra):
    task = {"type": task_type, "index": index}
    env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": task}),
           "GPULAB_STRATEGY": strategy, "GPULAB_JOB_NAME": "digits",
           "GPULAB_JOB_DIR": "/jobs/digits"}
    env.update(extra)
    return env


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,message",
    [
        (None, "TF_CONFIG is not set"),
        ("  ", "TF_CONFIG is not set"),
        ("{cluster", "TF_CONFIG is not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"task": {"type": "chief", "index": 0}}', "'cluster' must be an object"),
        ('{"cluster": {"boss": ["a:1"]}, "task": {"type": "chief"}}', "unknown role 'boss'"),
        ('{"cluster": {"worker": []}, "task": {"type": "worker"}}', "non-empty list"),
        ('{"cluster": {"worker": ["nohost"]}, "task": {"type": "worker"}}', "'host:port'"),
        ('{"cluster": {"worker": ["a:99999"]}, "task": {"type": "worker"}}', "'host:port'"),
        ('{"cluster": {"worker": ["a:1"]}}', "'task' must be an object"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "master"}}',
         "task type 'master' is unknown"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}', "index -1"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}', "index '0'"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}}',
         "worker-1 is not in the cluster (it has 1 worker address(es))"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}}', "ps-0 is not in"),
    ],
    ids=["unset", "blank", "bad-json", "not-object", "no-cluster", "unknown-role", "empty-role",
         "no-port", "port-range", "no-task", "unknown-type", "negative-index", "string-index",
         "index-out-of-range", "type-not-in-cluster"],
)
def test_bad_tf_config(raw, message):
    with pytest.raises(rt.ConfigError) as e:
        rt.parse_tf_config(raw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_tf_config_evaluator_is_outside_the_cluster():
    raw = json.dumps({"cluster": PS_CLUSTER, "task": {"type": "evaluator", "index": 0}})
    assert rt.parse_tf_config(raw) == (PS_CLUSTER, "evaluator", 0)


@pytest.mark.parametrize(
    "strategy,cluster,task_type,message",
    [
        ("ring", MW_CLUSTER, "worker", "GPULAB_STRATEGY 'ring' is unknown"),
        ("parameter-server", {"ps": ["a:1"], "worker": ["a:2"]}, "ps", "exactly one chief"),
        ("parameter-server", {"chief": ["a:0"], "worker": ["a:2"]}, "chief", "at least one ps"),
        ("parameter-server", {"chief": ["a:0"], "ps": ["a:1"]}, "chief", "at least one worker"),
        ("multi-worker-mirrored", {"ps": ["a:1"], "worker": ["a:2"]}, "worker", "no ps tasks"),
        ("multi-worker-mirrored", {"chief": ["a:1", "a:3"], "worker": ["a:2"]}, "chief",
         "at most one chief"),
    ],
    ids=["unknown-strategy", "ps-no-chief", "ps-no-ps", "ps-no-worker", "mw-with-ps",
         "mw-two-chiefs"],
)
def test_cluster_must_fit_the_strategy(strategy, cluster, task_type, message):
    with pytest.raises(rt.ConfigError) as e:
        rt.validate_cluster(strategy, cluster, task_type)
    assert message in str(e.value)


def test_config_from_env():
    cfg = rt.config_from_env(env_of(PS_CLUSTER, "worker", 1))
    assert (cfg.strategy, cfg.task_type, cfg.task_index, cfg.name) == (
        "parameter-server", "worker", 1, "worker-1")
    assert cfg.cluster == PS_CLUSTER and cfg.job_dir == "/jobs/digits" and cfg.in_job
    # a TF_CONFIG made by other means: the strategy follows from the roles
    assert rt.config_from_env({"TF_CONFIG": env_of(PS_CLUSTER, "chief")["TF_CONFIG"]}).strategy \
        == "parameter-server"
    assert rt.config_from_env({"TF_CONFIG": env_of(MW_CLUSTER, "worker")["TF_CONFIG"]}).strategy \
        == "multi-worker-mirrored"
    with pytest.raises(rt.ConfigError, match="TF_CONFIG is not set"):
        rt.config_from_env({"GPULAB_STRATEGY": "parameter-server"})
    alone = rt.config_from_env({})
    assert not alone.in_job and alone.is_chief and alone.runs_program
    assert (alone.task_type, alone.task_index) == ("chief", 0)


@pytest.mark.parametrize(
    "cluster,task_type,index,strategy,chief,runs",
    [
        (PS_CLUSTER, "chief", 0, "parameter-server", True, True),
        (PS_CLUSTER, "ps", 0, "parameter-server", False, False),
        (PS_CLUSTER, "worker", 0, "parameter-server", False, False),
        (PS_CLUSTER, "evaluator", 0, "parameter-server", False, True),
        (MW_CLUSTER, "worker", 0, "multi-worker-mirrored", True, True),
        (MW_CLUSTER, "worker", 1, "multi-worker-mirrored", False, True),
        ({"chief": ["a:1"], "worker": ["a:2"]}, "worker", 0, "multi-worker-mirrored", False, True),
        ({"chief": ["a:1"], "worker": ["a:2"]}, "chief", 0, "multi-worker-mirrored", True, True),
    ],
    ids=["ps-chief", "ps-ps", "ps-worker", "ps-evaluator", "mw-worker0", "mw-worker1",
         "mw-worker0-with-chief", "mw-chief"],
)
def test_roles(cluster, task_type, index, strategy, chief, runs):
    cfg = rt.config_from_env(env_of(cluster, task_type, index, strategy))
    assert (cfg.is_chief, cfg.runs_program) == (chief, runs)


# -- paths ------------------------------------------------------------------------------------


def test_paths_in_a_job(tmp_path):
    chief = rt.config_from_env(env_of(MW_CLUSTER, "worker", 0, "multi-worker-mirrored"))
    other = rt.config_from_env(env_of(MW_CLUSTER, "worker", 1, "multi-worker-mirrored"))
    for cfg in (chief, other):  # the same shared folders on every replica
        assert rt.logdir_of(cfg) == Path("/jobs/digits/tensorboard")
        assert rt.checkpoint_dir_of(cfg) == Path("/jobs/digits/checkpoints")
    assert rt.writable_dir_of(chief, "/jobs/digits/tensorboard") == Path("/jobs/digits/tensorboard")
    tmp = rt.writable_dir_of(other, "/jobs/digits/tensorboard", tmp=str(tmp_path))
    assert tmp.parent.parent == tmp_path and tmp.name == "tensorboard"
    assert tmp.parent.name.startswith("gpulab-digits-worker-1-")


def test_paths_outside_a_job(tmp_path):
    alone = rt.config_from_env({})
    assert rt.logdir_of(alone, cwd=str(tmp_path)) == tmp_path / "tensorboard"
    assert rt.checkpoint_dir_of(alone, cwd=str(tmp_path)) == tmp_path / "checkpoints"
    assert rt.writable_dir_of(alone, tmp_path / "x") == tmp_path / "x"


def test_helpers_outside_a_job(monkeypatch, tmp_path, capsys):
    for k in ("TF_CONFIG", "GPULAB_STRATEGY", "GPULAB_JOB_DIR", "GPULAB_JOB_NAME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    assert rt.is_chief() and rt.task() == ("chief", 0)
    assert rt.logdir() == str(tmp_path / "tensorboard") and (tmp_path / "tensorboard").is_dir()
    assert rt.checkpoint_dir() == str(tmp_path / "checkpoints")
    rt.report(3, total=10, loss=0.5)
    assert rt.parse_progress_line(capsys.readouterr().out)["step"] == 3


def test_helpers_in_a_job(monkeypatch, tmp_path):
    env = env_of(MW_CLUSTER, "worker", 1, "multi-worker-mirrored", GPULAB_JOB_DIR=str(tmp_path))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert not rt.is_chief() and rt.task() == ("worker", 1)
    assert rt.checkpoint_dir() == str(tmp_path / "checkpoints")
    monkeypatch.setenv("TF_CONFIG", "{")
    with pytest.raises(RuntimeError, match="gpulab runtime: TF_CONFIG is not valid JSON"):
        rt.task()


def test_helpers_are_lent_to_the_package_without_tensorflow():
    code = ("import sys, gpulab.extensions as g; from gpulab.extensions import runtime; "
            "assert g.report is runtime.report and g.strategy is runtime.strategy; "
            "import os; print(os.environ['TF_USE_LEGACY_KERAS'], os.environ['GRPC_FAIL_FAST'], "
            "'tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, check=True).stdout
    assert out.split() == ["1", "use_caller", "False"]


# -- exit codes -------------------------------------------------------------------------------


def tf_error(name, message="", module="tensorflow.python.framework.errors_impl"):
    """An exception class shaped like TensorFlow's (tf.errors.* derive from OpError)."""
    op_error = type("OpError", (Exception,), {"__module__": module})
    return type(name, (op_error,), {"__module__": module})(message)


def raised_from(outer, inner):
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer from e
    except BaseException as e:
        return e


@pytest.mark.parametrize(
    "exc,code",
    [
        (None, rt.EXIT_OK),
        (SystemExit(None), rt.EXIT_OK),
        (SystemExit(0), rt.EXIT_OK),
        (SystemExit(3), 3),
        (SystemExit("bad arguments"), rt.EXIT_PROGRAM),
        (KeyboardInterrupt(), 130),
        (ValueError("shapes (2,) and (3,) differ"), rt.EXIT_PROGRAM),
        (tf_error("UnavailableError", "recvmsg:Connection reset by peer"), rt.EXIT_INFRA),
        (tf_error("AbortedError", "Collective ops is aborted"), rt.EXIT_INFRA),
        (tf_error("PSUnavailableError", "ps 0", "tensorflow.python.distribute.coordinator"),
         rt.EXIT_INFRA),
        (tf_error("InvalidArgumentError",
                  "Unable to find the relevant tensor remote_handle: Op ID: 9"), rt.EXIT_INFRA),
        (tf_error("UnknownError", "Graph execution error: Socket closed"), rt.EXIT_INFRA),
        (tf_error("InvalidArgumentError", "Unable to find a context_id matching the specified "
                  "one (42). Perhaps the worker was restarted"), rt.EXIT_INFRA),
        # a user's mistake on a remote device names the device, but is the user's
        (tf_error("InvalidArgumentError", "Incompatible shapes on /job:ps/replica:0/task:0"),
         rt.EXIT_PROGRAM),
        (tf_error("ResourceExhaustedError", "OOM when allocating tensor"), rt.EXIT_PROGRAM),
        # the same phrase in a non-TensorFlow error is the program's own
        (ConnectionRefusedError("Connection refused"), rt.EXIT_PROGRAM),
        (raised_from(RuntimeError("fit failed"), tf_error("UnavailableError", "ps gone")),
         rt.EXIT_INFRA),
        (raised_from(tf_error("UnavailableError", "ps gone"), ValueError("x")), rt.EXIT_INFRA),
    ],
    ids=["returned", "exit-none", "exit-0", "exit-3", "exit-message", "interrupt", "value-error",
         "unavailable", "aborted", "ps-unavailable", "remote-handle", "socket-closed",
         "context-id", "user-op-error-on-ps", "oom", "plain-connection-error", "caused-by-infra",
         "infra-caused-by-user"],
)
def test_exit_code_for(exc, code):
    assert rt.exit_code_for(exc) == code


def test_wrapped_original_exception_is_followed():
    wrapper = tf_error("ClosureInputError", "Other function has an execution error")
    wrapper.original_exception = tf_error("UnavailableError", "ps gone")
    assert rt.is_infra_error(wrapper)


def test_exit_code_constants():
    assert (rt.EXIT_OK, rt.EXIT_PROGRAM, rt.EXIT_CONFIG, rt.EXIT_INFRA) == (0, 1, 2, 75)
    from gpulab.hub.jobs import rules
    # the exits the hub never retries are the runtime's program and configuration errors
    assert rules.PROGRAM_ERRORS == (rt.EXIT_PROGRAM, rt.EXIT_CONFIG)
    assert rules.exit_words(rt.EXIT_INFRA).startswith("lost its cluster")


# -- main: bad configuration exits 2 with one line, before TensorFlow --------------------------


@pytest.mark.parametrize(
    "env,argv,message",
    [
        ({}, ["prog.py"], "bad configuration: TF_CONFIG is not set"),
        ({"TF_CONFIG": "{", "GPULAB_STRATEGY": "parameter-server"}, ["prog.py"],
         "TF_CONFIG is not valid JSON"),
        (env_of(PS_CLUSTER, "chief", strategy="ring"), ["prog.py"], "GPULAB_STRATEGY 'ring'"),
        (env_of(PS_CLUSTER, "boss"), ["prog.py"], "task type 'boss' is unknown"),
        (env_of(PS_CLUSTER, "chief"), ["missing.py"], "the program missing.py does not exist"),
        (env_of(PS_CLUSTER, "chief"), [], "usage: python -m gpulab.extensions.runtime"),
    ],
    ids=["no-tf-config", "bad-json", "unknown-strategy", "unknown-task-type", "no-program",
         "no-arguments"],
)
def test_main_bad_configuration(monkeypatch, tmp_path, capsys, env, argv, message):
    for k in ("TF_CONFIG", "GPULAB_STRATEGY", "GPULAB_JOB_DIR", "GPULAB_JOB_NAME"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prog.py").write_text("raise SystemExit(9)\n")
    assert rt.main(argv) == rt.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("gpulab runtime: bad configuration: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


# -- progress lines ---------------------------------------------------------------------------


class Scalar:
    """Like a numpy or TensorFlow scalar: converts with float() and has a dtype."""

    def __init__(self, value, dtype):
        self.value, self.dtype = value, dtype

    def __float__(self):
        return float(self.value)


def test_progress_line_format():
    line = rt.progress_line(120, total=600, loss=0.31, accuracy=Scalar(0.912345678, "float32"),
                            seen=Scalar(7680, "int64"), lr=float("nan"), phase="train")
    assert line.startswith("GPULAB_PROGRESS {\"step\": 120, \"total\": 600, \"loss\": 0.31, ")
    assert "\n" not in line
    record = rt.parse_progress_line(line)
    assert record["accuracy"] == 0.912346 and record["seen"] == 7680 and record["lr"] is None
    assert record["phase"] == "train" and isinstance(record["time"], float)
    assert "total" not in rt.parse_progress_line(rt.progress_line(5))


@pytest.mark.parametrize("kwargs,error", [
    ({"step": -1}, "step must be >= 0"),
    ({"step": 1, "time": 3}, "'time' is reserved"),
])
def test_progress_line_refuses(kwargs, error):
    with pytest.raises(ValueError, match=error):
        rt.progress_line(**kwargs)


@pytest.mark.parametrize("line", [
    "Epoch 1/8", "GPULAB_PROGRESS not json", 'GPULAB_PROGRESS {"total": 3}',
    'GPULAB_PROGRESS {"step": "3"}', "GPULAB_PROGRESS [1]",
])
def test_parse_progress_ignores_other_lines(line):
    assert rt.parse_progress_line(line) is None


def test_wait_for_cluster_reports_who_is_missing():
    import socket

    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refuses connections
        up = f"127.0.0.1:{listening.getsockname()[1]}"
        down = f"127.0.0.1:{closed.getsockname()[1]}"
        said = []
        assert rt.wait_for_cluster({"ps-0": up, "worker-0": down}, 0.6, said.append) == ["worker-0"]
        assert said == ["waiting for worker-0 to come up"]
        assert rt.wait_for_cluster({"ps-0": up}, 5) == []


def test_main_leaves_its_exit_code_for_an_adopting_service(monkeypatch, tmp_path):
    for k, v in env_of(PS_CLUSTER, "chief", GPULAB_JOB_DIR=str(tmp_path)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    exit_file = tmp_path / "logs" / "chief-0.exit"
    exit_file.write_text("0\n")  # the last run's
    assert rt.main(["missing.py"]) == rt.EXIT_CONFIG
    assert exit_file.read_text() == "2\n"
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["chief-0.exit"]
    assert rt.exit_file_of(rt.config_from_env({})) is None


# -- main: the program is the first to touch TensorFlow (issue 34) ---------------------------

FIRST = """
import sys
print("tensorflow imported before the program:", "tensorflow" in sys.modules, flush=True)
"""


def run_runtime(tmp_path, env, program=FIRST):
    (tmp_path / "prog.py").write_text(program)
    return subprocess.run([sys.executable, "-m", "gpulab.extensions.runtime", "prog.py"],
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("simulated", [False, True], ids=["real-gpus", "simulated-gpus"])
def test_a_worker_runs_the_program_before_tensorflow_is_imported(tmp_path, simulated):
    """No strategy, no TensorFlow before the program: its tf.config set-up comes first.
    Where the GPUs are simulated (TF_ENABLED_DEVICE_TYPES=CPU), the first line says so."""
    extra = {"CUDA_VISIBLE_DEVICES": "1", **({"TF_ENABLED_DEVICE_TYPES": "CPU"} if simulated
                                             else {})}
    out = run_runtime(tmp_path, env_of(MW_CLUSTER, "worker", 1, "multi-worker-mirrored",
                                       GPULAB_JOB_DIR=str(tmp_path), **extra))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "tensorflow imported before the program: False\n"
    said = "gpulab runtime: worker-1 running prog.py"
    assert out.stderr == said + (" (GPU 1 simulated: no CUDA here, TensorFlow uses the CPU)"
                                 if simulated else "") + "\n"


def test_a_parameter_server_chief_waits_for_its_cluster_without_tensorflow(tmp_path):
    """The coordinator waits for every ps and worker with plain TCP, then runs the program,
    still before TensorFlow; a peer that never comes up exits EXIT_INFRA."""
    import socket

    listening = []
    try:
        for _ in range(3):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            listening.append(s)
        up = [f"127.0.0.1:{s.getsockname()[1]}" for s in listening]
        cluster = {"chief": ["127.0.0.1:1"], "ps": up[:1], "worker": up[1:]}
        out = run_runtime(tmp_path, env_of(cluster, "chief", GPULAB_JOB_DIR=str(tmp_path)))
        assert out.returncode == 0, out.stderr
        assert out.stdout == "tensorflow imported before the program: False\n"
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))  # bound, never listening: refuses connections
            cluster["worker"] = [f"127.0.0.1:{closed.getsockname()[1]}"]
            out = run_runtime(tmp_path, env_of(cluster, "chief", GPULAB_JOB_DIR=str(tmp_path),
                                               GPULAB_CLUSTER_TIMEOUT="0.5"))
        assert out.returncode == rt.EXIT_INFRA and out.stdout == ""
        assert "worker-0 did not come up within 0.5 s; exit 75 (cluster lost)" in out.stderr
    finally:
        for s in listening:
            s.close()


# -- a held cluster (GPULAB_KIND=cluster, issue 38) ------------------------------------------

HELD = {"ps": ["127.0.0.1:2001"], "worker": ["127.0.0.1:2002", "127.0.0.1:2003"]}


def test_a_held_clusters_replicas_only_serve():
    for role, index in (("ps", 0), ("worker", 1)):
        cfg = rt.config_from_env({**env_of(HELD, role, index), "GPULAB_KIND": "cluster"})
        assert cfg.kind == "cluster" and not cfg.runs_program and not cfg.is_chief
    # without the kind, the same TF_CONFIG lacks a coordinator
    with pytest.raises(rt.ConfigError, match="exactly one chief"):
        rt.config_from_env(env_of(HELD, "ps", 0))


@pytest.mark.parametrize("cluster, task_type, kind, message", [
    ({"chief": ["a:1"], **HELD}, "ps", "cluster", "only ps and worker"),
    ({"ps": ["a:1"]}, "ps", "cluster", "at least one worker"),
    (HELD, "ps", "pool", "GPULAB_KIND 'pool' is unknown"),
], ids=["chief", "no-worker", "unknown-kind"])
def test_a_held_cluster_config_that_cannot_serve(cluster, task_type, kind, message):
    with pytest.raises(rt.ConfigError, match=message):
        rt.config_from_env({**env_of(cluster, task_type, 0), "GPULAB_KIND": kind})


def test_a_held_clusters_replica_needs_no_program(monkeypatch, tmp_path, capsys):
    # no program argument: the usage error is for jobs; a config error still says itself
    monkeypatch.setenv("GPULAB_KIND", "cluster")
    monkeypatch.setenv("GPULAB_STRATEGY", "parameter-server")
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": ["a:1"]},
                                                "task": {"type": "ps", "index": 0}}))
    assert rt.main([]) == rt.EXIT_CONFIG
    assert "at least one worker" in capsys.readouterr().err
