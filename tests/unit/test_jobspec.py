"""The job spec's rules, as a table: each bad spec is refused with the field it names."""

import os
import pytest

from gpulab.hub.jobs.spec import DEFAULT_LIMITS, JobLimits, SpecError, parse_spec

PS = {"name": "digits", "strategy": "parameter-server",
      "replicas": {"chief": 1, "ps": 1, "worker": 2},
      "resources": {"worker": {"gpus": 1}}, "source": "print('hi')"}
MW = {"name": "mw", "strategy": "multi-worker-mirrored", "replicas": {"worker": 2},
      "resources": {"worker": {"gpus": 2}}, "script": "train/main.py"}


def with_(base, **changes):
    out = {**base}
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


BAD = [
    ("zero workers", with_(PS, replicas={"chief": 1, "ps": 1, "worker": 0}), "replicas.worker"),
    ("unknown strategy", with_(PS, strategy="horovod"), "strategy"),
    ("two chiefs", with_(PS, replicas={"chief": 2, "ps": 1, "worker": 1}), "replicas.chief"),
    ("no chief", with_(PS, replicas={"chief": 0, "ps": 1, "worker": 1}), "replicas.chief"),
    ("no ps", with_(PS, replicas={"chief": 1, "ps": 0, "worker": 1}), "replicas.ps"),
    ("ps in multi-worker", with_(MW, replicas={"ps": 1, "worker": 2}), "replicas.chief"),
    ("negative workers", with_(MW, replicas={"worker": -1}), "replicas.worker"),
    ("workers as text", with_(MW, replicas={"worker": "2"}), "replicas.worker"),
    ("script outside", with_(MW, script="/etc/passwd.py"), "script"),
    ("dot-dot", with_(MW, script="../bob/train.py"), "script"),
    ("dot-dot inside", with_(MW, script="a/../../bob/train.py"), "script"),
    ("not python", with_(MW, script="train.sh"), "script"),
    ("both codes", with_(PS, script="train.py"), "script"),
    ("no code", with_(PS, source=None), "script"),
    ("empty source", with_(PS, source="   "), "source"),
    ("override TF_CONFIG", with_(PS, env={"TF_CONFIG": "{}"}), "env"),
    ("override CUDA", with_(PS, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}), "env"),
    ("override GPULAB_", with_(PS, env={"GPULAB_JOB_DIR": "/"}), "env"),
    ("bad env name", with_(PS, env={"A-B": "1"}), "env"),
    ("oversize source", with_(PS, source="x = 1\n" * 50_000), "source"),
    ("bad name", with_(PS, name="Digits_1"), "name"),
    ("name too long", with_(PS, name="a" * 41), "name"),
    ("unknown field", with_(PS, urgency=3), "urgency"),
    ("priority out of range", with_(PS, priority=101), "priority"),
    ("wait not a boolean", with_(PS, wait="no"), "wait"),
    ("resources of absent role", with_(PS, resources={"evaluator": {"gpus": 1}}),
     "resources.evaluator"),
    ("unknown role", with_(PS, resources={"master": {"gpus": 1}}), "resources.master"),
    ("negative gpus", with_(PS, resources={"worker": {"gpus": -1}}), "resources.worker.gpus"),
    ("too many gpus", with_(PS, resources={"worker": {"gpus": 9}}), "resources.worker.gpus"),
    ("bad memory", with_(PS, resources={"worker": {"memory": "lots"}}),
     "resources.worker.memory"),
    ("too many replicas", with_(MW, replicas={"worker": 33}), "replicas"),
    ("zero runtime", with_(PS, max_runtime=0), "max_runtime"),
    ("image not allowed", with_(PS, image="evil/miner:latest"), "image"),
    ("too many retries", with_(PS, retries=11), "retries"),
    ("not an object", ["digits"], "body"),
    # more files of the program (``files``): plain names only, with ``source``, bounded
    *[(f"file name {n!r}", with_(PS, files={n: "x = 1\n"}), "files") for n in (
        "../x.py", "..", ".", "", "/etc/passwd", "a/b.py", "a\\b.py", ".hidden.py", "~x.py",
        "x.py\n", " x.py", "x y.py", "source.py", "__pycache__", "a" * 101,
        "\uff0e\uff0e\uff0fx.py",  # fullwidth "../"
        "x\u202egnp.py",  # right-to-left override
        "x\u200b.py",  # zero-width space
        "caf\u00e9.py",  # not ASCII
        "x.py\x00", "C:x.py", "x:y.py")],
    ("files with script", with_(MW, files={"util.py": "x = 1"}), "files"),
    ("file text not text", with_(PS, files={"util.py": 3}), "files.util.py"),
    ("files not a map", with_(PS, files=["util.py"]), "files"),
    ("too many files", with_(PS, files={f"m{i}.py": "" for i in range(65)}), "files"),
    ("oversize files", with_(PS, files={"a.py": "x = 1\n" * 30_000,
                                        "b.py": "x = 1\n" * 30_000}), "files"),
]


@pytest.mark.parametrize("body,field", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_specs_name_the_field(body, field):
    with pytest.raises(SpecError) as e:
        parse_spec(body)
    assert e.value.field == field, e.value.message
    assert e.value.message.startswith(field) or field == "body", e.value.message


def test_parameter_server_spec_counts_gpus_over_its_replicas():
    spec = parse_spec(PS)
    assert spec.total_gpus == 2
    assert spec.replica_names() == [("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)]


def test_multi_worker_spec_and_allowed_image():
    spec = parse_spec(with_(MW, image="gpulab/singleuser:1"),
                      JobLimits(allowed_images=("gpulab/singleuser:1",)))
    assert spec.total_gpus == 4 and spec.script == "train/main.py"
    assert spec.replica_names() == [("worker", 0), ("worker", 1)]


def test_limits_are_configurable():
    with pytest.raises(SpecError) as e:
        parse_spec(with_(MW, replicas={"worker": 3}), JobLimits(max_replicas=2))
    assert e.value.field == "replicas" and "at most 2" in e.value.message


def test_replica_bounds_are_settings_carried_to_the_service():
    """c.GPUJobs.default_cpu / default_memory / max_replicas_per_user reach the service in
    the limits JSON; a role's own cpu/memory win over the defaults."""
    from traitlets.config import Config
    from traitlets import TraitError

    from gpulab.hub.jobs.spec import GPUJobs, Resources, limits_from_json

    assert DEFAULT_LIMITS.default_cpu == 2.0 and DEFAULT_LIMITS.default_memory == "8Gi"
    assert DEFAULT_LIMITS.max_replicas_per_user == 32
    c = Config()
    c.GPUJobs.default_cpu = 0.5
    c.GPUJobs.default_memory = "512Mi"
    c.GPUJobs.max_replicas_per_user = 6
    limits = limits_from_json(GPUJobs(config=c).limits_json())
    assert (limits.default_cpu, limits.default_memory, limits.max_replicas_per_user) == (
        0.5, "512Mi", 6)
    assert limits.cpu_of(None) == 0.5 and limits.memory_of(None) == "512Mi"
    own = Resources(gpus=1, cpu=4.0, memory="2Gi")
    assert limits.cpu_of(own) == 4.0 and limits.memory_of(own) == "2Gi"
    assert limits.cpu_of(Resources(gpus=1)) == 0.5
    off = JobLimits(default_cpu=0, default_memory="")
    assert off.cpu_of(None) is None and off.memory_of(None) is None
    with pytest.raises(TraitError, match="default_memory"):
        GPUJobs(default_memory="lots")
    spec = parse_spec(with_(MW, replicas={"worker": 3}))
    assert spec.replica_count == 3


def test_files_go_beside_the_source_and_count_against_its_bytes():
    spec = parse_spec(with_(PS, files={"mnist_setup.py": "import os\n", "data.json": "{}",
                                       "_x-1.2": ""}))
    assert spec.files == {"mnist_setup.py": "import os\n", "data.json": "{}", "_x-1.2": ""}
    assert spec.code_bytes == len("print('hi')") + 10 + 2
    lim = JobLimits(max_source_bytes=spec.code_bytes - 1)
    with pytest.raises(SpecError) as e:
        parse_spec(with_(PS, files=spec.files), lim)
    assert e.value.field == "files" and "source and files together" in e.value.message
    assert parse_spec(PS).files == {}  # old specs (stored ones too) have none


def test_process_bounds_reach_the_service():
    """``c.GPUJobs.pids_per_replica`` / ``max_user_processes`` travel to the service in the
    limits' JSON; their defaults come from the machine (512 a replica up to 128 CPUs, a
    quarter of pid_max / threads-max for the account)."""
    from traitlets.config import Config

    from gpulab.hub.jobs.spec import GPUJobs, limits_from_json
    from gpulab.hub.machine.cgroups import default_user_processes

    plain = limits_from_json(GPUJobs().limits_json())
    assert plain.pids_per_replica == max(512, 4 * os.cpu_count())
    assert plain.max_user_processes == default_user_processes() >= 1024
    c = Config()
    c.GPUJobs.pids_per_replica = 64
    c.GPUJobs.max_user_processes = 0
    mine = limits_from_json(GPUJobs(config=c).limits_json())
    assert (mine.pids_per_replica, mine.max_user_processes) == (64, 0)


DEFAULT_LIMIT = [
    # (id, spec's max_runtime, c.GPUJobs settings, the job's time limit)
    ("no limit in the spec: the operator's default (a day)", None, {}, 86400),
    ("the spec's own limit wins", 300, {}, 300),
    ("a default set by the operator", None, {"default_max_runtime": 600}, 600),
    ("no default (0): none", None, {"default_max_runtime": 0}, None),
    ("the default never passes the longest allowed", None,
     {"default_max_runtime": 7200, "max_runtime": 3600}, 3600),
]


@pytest.mark.parametrize("name,own,settings,limit", DEFAULT_LIMIT,
                         ids=[r[0] for r in DEFAULT_LIMIT])
def test_default_time_limit(name, own, settings, limit):
    from gpulab.hub.jobs.spec import GPUJobs, limits_from_json
    body = {"name": "j", "strategy": "multi-worker-mirrored", "source": "print(1)"}
    if own is not None:
        body["max_runtime"] = own
    lim = limits_from_json(GPUJobs(**settings).limits_json())  # as the service gets them
    spec = lim.with_time_limit(parse_spec(body, lim))
    assert spec.max_runtime == limit


def test_job_limits_are_declared_once():
    """Every ``c.GPUJobs`` setting but ``python`` is a `JobLimits` field whose default it
    takes from there, and `GPUJobs.limits` hands each over (set to something else, it
    arrives as set); nothing lists them a third time."""
    import dataclasses

    from traitlets.config import Config

    from gpulab.hub.jobs.spec import GPUJobs, limit_settings, limits_from_json

    names = limit_settings()
    assert set(GPUJobs.class_traits(config=True)) - set(names) == {"python"}
    for name in names:
        trait = GPUJobs.class_traits()[name]
        if name not in ("pids_per_replica", "max_user_processes", "allowed_images"):  # computed
            assert trait.default_value == getattr(DEFAULT_LIMITS, name), name
    c = Config()
    other = {}
    for name in names:
        value = getattr(DEFAULT_LIMITS, name)
        other[name] = (("gpulab/x:1",) if name == "allowed_images"
                       else "4Gi" if name == "default_memory"
                       else 3 * 3600 if name == "default_max_runtime"
                       else 4 * 3600 if name == "max_runtime" else type(value)(7))
        setattr(c.GPUJobs, name, list(other[name]) if name == "allowed_images" else other[name])
    got = limits_from_json(GPUJobs(config=c).limits_json())
    assert {name: getattr(got, name) for name in names} == other
    assert all(getattr(got, f.name) == getattr(DEFAULT_LIMITS, f.name)
               for f in dataclasses.fields(got) if f.name not in names)


CLUSTER = {"name": "held", "kind": "cluster", "strategy": "parameter-server",
           "replicas": {"ps": 2, "worker": 4}, "resources": {"worker": {"gpus": 1}}}


def test_a_cluster_is_parameter_servers_and_workers_without_code():
    spec = parse_spec(CLUSTER)
    assert spec.is_cluster and spec.kind == "cluster"
    assert spec.replica_names() == [("ps", 0), ("ps", 1)] + [("worker", i) for i in range(4)]
    assert spec.total_gpus == 4
    job = parse_spec({"name": "j", "strategy": "multi-worker-mirrored", "script": "t.py"})
    assert job.kind == "job" and not job.is_cluster


@pytest.mark.parametrize("change, field, words", [
    ({"strategy": "multi-worker-mirrored"}, "strategy", "parameter-server"),
    ({"replicas": {"chief": 1, "ps": 1, "worker": 1}}, "replicas.chief", "no chief"),
    ({"replicas": {"ps": 0, "worker": 1}}, "replicas.ps", "at least 1 ps"),
    ({"replicas": {"ps": 1, "worker": 0}}, "replicas.worker", "at least 1 worker"),
    ({"replicas": {"ps": 1, "worker": 1, "evaluator": 1}}, "replicas.evaluator", "no evaluator"),
    ({"resources": {"chief": {"gpus": 1}}}, "resources.chief", "no chief replicas"),
    ({"script": "train.py"}, "script", "no program"),
    ({"source": "print(1)"}, "source", "no program"),
    ({"args": ["--x"]}, "args", "no program"),
    ({"kind": "pool"}, "kind", "'job' or 'cluster'"),
])
def test_a_cluster_spec_that_cannot_be_held_names_its_field(change, field, words):
    with pytest.raises(SpecError) as e:
        parse_spec({**CLUSTER, **change})
    assert e.value.field == field, str(e.value)
    assert words in str(e.value)
