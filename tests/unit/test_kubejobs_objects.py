"""The Kubernetes objects of a training job (gpulab.hub.jobs.kubeobjects), as literal dicts."""

import json
import re

from gpulab.hub.jobs.spec import parse_spec
from gpulab.hub.jobs.kubeobjects import (
    REPLICA_COMMAND,
    Placement,
    make_job_network_policy,
    make_tfjob,
    make_training_job_objects,
    make_training_jobset,
)
from tests.cluster.kubelet import expand as kubelet_expand

PS_SPEC = {
    "name": "digits", "strategy": "parameter-server",
    "replicas": {"chief": 1, "ps": 1, "worker": 2},
    "resources": {"worker": {"gpus": 2, "cpu": 4, "memory": "8Gi"}},
    "script": "train.py", "args": ["--epochs", "3"], "env": {"MODE": "a$(HOME)b"},
    "max_runtime": 3600, "retries": 3,
}
SHARED = {"nfs": {"server": "nfs.example.org", "path": "/gpulab"}}
LABELS = {"app.kubernetes.io/managed-by": "gpulab", "app.kubernetes.io/component": "training-job",
          "gpulab.io/user": "ann", "gpulab.io/job": "digits"}
NS = "gpulab-ann"
HOSTS = {
    "chief": ["digits-chief-0.digits.gpulab-ann.svc:2222"],
    "ps": ["digits-ps-0.digits.gpulab-ann.svc:2222"],
    "worker": ["digits-worker-0.digits.gpulab-ann.svc:2222",
               "digits-worker-1.digits.gpulab-ann.svc:2222"],
}


def placement(**kw) -> Placement:
    """Ann's job's `Placement`, with `kw` changed."""
    args = dict(namespace=NS, user_label="ann", image="gpulab/singleuser:1",
                program="/gpulab/shared/users/ann/train.py",
                job_dir="/gpulab/shared/users/ann/jobs/digits",
                user_dir="/gpulab/shared/users/ann", gpu_model="NVIDIA-H100",
                shared_volume=SHARED, user_subpath="users/ann", datasets_subpath="datasets")
    args.update(kw)
    return Placement(**args)


def build(spec=PS_SPEC, parent_uid="uid-1", **kw):
    return make_training_job_objects(parse_spec(spec), placement(**kw), parent_uid=parent_uid)


def env_of(role, tf_config):
    return [
        {"name": "GPULAB_TASK_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        {"name": "TF_CONFIG", "value": tf_config},
        {"name": "GPULAB_STRATEGY", "value": "parameter-server"},
        {"name": "GPULAB_JOB_NAME", "value": "digits"},
        {"name": "GPULAB_JOB_DIR", "value": "/gpulab/shared/users/ann/jobs/digits"},
        {"name": "GPULAB_USER_DIR", "value": "/gpulab/shared/users/ann"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "GPULAB_SHARED_DIR", "value": "/gpulab/shared"},
        {"name": "GPULAB_DATASETS_DIR", "value": "/gpulab/shared/datasets"},
        {"name": "MODE", "value": "a$$(HOME)b"},
    ]


def test_service_is_the_headless_parent():
    svc = build()[0]
    assert svc == {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "digits", "namespace": NS, "labels": LABELS},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {"gpulab.io/user": "ann", "gpulab.io/job": "digits"},
                 "ports": [{"name": "tf", "port": 2222, "targetPort": 2222}]},
    }


def test_one_indexed_job_per_role_owned_by_the_service():
    objs = build()
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("Service", "digits"), ("Job", "digits-chief"), ("Job", "digits-ps"), ("Job", "digits-worker")]
    for o in objs[1:]:
        assert o["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Service", "name": "digits", "uid": "uid-1"}]
    assert "ownerReferences" not in build(parent_uid=None)[1]["metadata"]


def test_worker_job_literal():
    worker = build()[3]
    tf_config = ('{"cluster": ' + json.dumps(HOSTS) + ', "task": {"type": "worker", '
                 '"index": $(GPULAB_TASK_INDEX)}}')
    labels = {**LABELS, "gpulab.io/role": "worker"}
    assert worker == {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "digits-worker", "namespace": NS, "labels": labels,
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Service",
                                          "name": "digits", "uid": "uid-1"}]},
        "spec": {
            "completionMode": "Indexed", "completions": 2, "parallelism": 2,
            "backoffLimit": 3, "podReplacementPolicy": "Failed", "activeDeadlineSeconds": 3600,
            "podFailurePolicy": {"rules": [
                {"action": "Ignore",
                 "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {"action": "FailJob", "onExitCodes": {"containerName": "tensorflow",
                                                      "operator": "In", "values": [2]}},
            ]},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": "tensorflow",
                        "image": "gpulab/singleuser:1",
                        "command": ["sh", "-c", 'mkdir -p "$GPULAB_JOB_DIR/logs" && '
                                    'cd "$GPULAB_JOB_DIR" && exec python -m '
                                    'gpulab.extensions.runtime "$@"', "gpulab-replica",
                                    "/gpulab/shared/users/ann/train.py", "--epochs", "3"],
                        "workingDir": "/gpulab/shared/users/ann",
                        "env": env_of("worker", tf_config),
                        "ports": [{"name": "tf", "containerPort": 2222}],
                        "resources": {"requests": {"cpu": "4", "memory": "8Gi"},
                                      "limits": {"cpu": "4", "memory": "8Gi",
                                                 "nvidia.com/gpu": "2"}},
                        "securityContext": {"allowPrivilegeEscalation": False,
                                            "privileged": False},
                        "volumeMounts": [
                            {"name": "gpulab-shared", "mountPath": "/gpulab/shared/users/ann",
                             "subPath": "users/ann"},
                            {"name": "gpulab-shared", "mountPath": "/gpulab/shared/datasets",
                             "subPath": "datasets", "readOnly": True},
                        ],
                    }],
                    "volumes": [{"name": "gpulab-shared", **SHARED}],
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                     "effect": "NoSchedule"}],
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
                    "subdomain": "digits",
                },
            },
        },
    }


def test_cpu_roles_get_no_gpu_settings_and_no_host_paths():
    chief = build()[1]["spec"]["template"]["spec"]
    assert "tolerations" not in chief and "nodeSelector" not in chief
    assert chief["containers"][0]["resources"] == {}
    for o in build():
        text = json.dumps(o)
        assert "hostPath" not in text and '"privileged": true' not in text


def test_every_replica_gets_the_container_defaults_of_what_its_role_names_none_of():
    """The operator's defaults (the backend's `container_defaults`) are in each replica's
    template, for Indexed Jobs, JobSets and TFJobs alike (no LimitRange in the namespace:
    issue 40); a role's own CPU, memory and GPUs are kept."""
    from gpulab.hub.cluster.kubeobjects import container_defaults
    from gpulab.hub.jobs.kubeobjects import make_tfjob, make_training_jobset

    limits, requests = container_defaults(
        limits={"cpu": "2", "memory": "8Gi", "ephemeral-storage": "20Gi"},
        requests={"cpu": "100m", "memory": "512Mi", "ephemeral-storage": "1Gi"})
    where = placement(container_limits=limits, container_requests=requests)
    spec = parse_spec(PS_SPEC)
    chief = {"limits": {"cpu": "2", "memory": "8Gi", "ephemeral-storage": "20Gi"},
             "requests": {"cpu": "100m", "memory": "512Mi", "ephemeral-storage": "1Gi"}}
    worker = {"limits": {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "2",
                         "ephemeral-storage": "20Gi"},
              "requests": {"cpu": "4", "memory": "8Gi", "ephemeral-storage": "1Gi"}}
    jobs = make_training_job_objects(spec, where, parent_uid="uid-1")[1:]
    by_role = {j["metadata"]["name"].rsplit("-", 1)[1]:
               j["spec"]["template"]["spec"]["containers"][0]["resources"] for j in jobs}
    assert by_role == {"chief": chief, "ps": chief, "worker": worker}
    jobset = make_training_jobset(spec, where)
    assert {r["name"]: r["template"]["spec"]["template"]["spec"]["containers"][0]["resources"]
            for r in jobset["spec"]["replicatedJobs"]} == by_role
    tfjob = make_tfjob(spec, where)
    assert {role.lower(): r["template"]["spec"]["containers"][0]["resources"]
            for role, r in tfjob["spec"]["tfReplicaSpecs"].items()} == by_role


def expand(value, index):
    """What the kubelet does with the TF_CONFIG template (dependent variables)."""
    return re.sub(r"(?<!\$)\$\(GPULAB_TASK_INDEX\)", str(index), value)


def test_tf_config_expands_per_pod_to_valid_json():
    from gpulab.extensions.runtime import parse_tf_config

    for job, role in ((build()[1], "chief"), (build()[3], "worker")):
        env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        for i in range(job["spec"]["completions"]):
            cfg = json.loads(expand(env["TF_CONFIG"], i))
            assert cfg == {"cluster": HOSTS, "task": {"type": role, "index": i}}
            parse_tf_config(expand(env["TF_CONFIG"], i))  # the runtime accepts it


def test_multi_worker_without_shared_storage_or_deadline():
    spec = {"name": "mw", "strategy": "multi-worker-mirrored", "replicas": {"worker": 2},
            "source": "print(1)", "retries": 0}
    objs = build(spec, shared_volume=None, gpu_model=None, parent_uid=None)
    assert [o["metadata"]["name"] for o in objs] == ["mw", "mw-worker"]
    job = objs[1]["spec"]
    assert "activeDeadlineSeconds" not in job and job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    assert "volumes" not in pod and "volumeMounts" not in pod["containers"][0]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert json.loads(expand(env["TF_CONFIG"], 1)) == {
        "cluster": {"worker": ["mw-worker-0.mw.gpulab-ann.svc:2222",
                               "mw-worker-1.mw.gpulab-ann.svc:2222"]},
        "task": {"type": "worker", "index": 1}}
    assert env["GPULAB_USER_DIR"] == "/gpulab/shared/users/ann"


def test_evaluator_is_outside_the_cluster():
    spec = {**PS_SPEC, "replicas": {"chief": 1, "ps": 1, "worker": 1, "evaluator": 1}}
    ev = build(spec)[-1]
    env = {e["name"]: e.get("value") for e in ev["spec"]["template"]["spec"]["containers"][0]["env"]}
    cfg = json.loads(expand(env["TF_CONFIG"], 0))
    assert "evaluator" not in cfg["cluster"] and cfg["task"] == {"type": "evaluator", "index": 0}


def test_tfjob_literal():
    spec = {"name": "digits", "strategy": "parameter-server",
            "replicas": {"chief": 1, "ps": 1, "worker": 2},
            "resources": {"worker": {"gpus": 1}}, "script": "train.py", "retries": 2}
    tfjob = make_tfjob(parse_spec(spec), Placement(
        namespace=NS, user_label="ann", image="img:1", program="/p/train.py",
        job_dir="/p/jobs/digits", user_dir="/p", gpu_model="NVIDIA-H100"))

    def pod(role, gpus):
        p = {
            "automountServiceAccountToken": False, "enableServiceLinks": False,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "tensorflow", "image": "img:1",
                "command": [*REPLICA_COMMAND, "/p/train.py"],
                "workingDir": "/p",
                "env": [{"name": "GPULAB_STRATEGY", "value": "parameter-server"},
                        {"name": "GPULAB_JOB_NAME", "value": "digits"},
                        {"name": "GPULAB_JOB_DIR", "value": "/p/jobs/digits"},
                        {"name": "GPULAB_USER_DIR", "value": "/p"},
                        {"name": "PYTHONUNBUFFERED", "value": "1"}],
                "ports": [{"name": "tfjob-port", "containerPort": 2222}],
                "resources": {"limits": {"nvidia.com/gpu": "1"}} if gpus else {},
                "securityContext": {"allowPrivilegeEscalation": False, "privileged": False},
            }],
        }
        if gpus:
            p["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
            p["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H100"}
        return {"metadata": {"labels": {**LABELS, "gpulab.io/role": role}}, "spec": p}

    assert tfjob == {
        "apiVersion": "kubeflow.org/v1", "kind": "TFJob",
        "metadata": {"name": "digits", "namespace": NS, "labels": LABELS},
        "spec": {
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 2},
            "tfReplicaSpecs": {
                "Chief": {"replicas": 1, "restartPolicy": "ExitCode", "template": pod("chief", 0)},
                "PS": {"replicas": 1, "restartPolicy": "ExitCode", "template": pod("ps", 0)},
                "Worker": {"replicas": 2, "restartPolicy": "ExitCode", "template": pod("worker", 1)},
            },
        },
    }


def test_a_parameter_server_chief_failing_with_its_own_error_is_not_retried():
    chief, ps = build()[1:3]
    assert chief["spec"]["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"] == [1, 2]
    assert ps["spec"]["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"] == [2]


def test_the_replica_command_makes_the_job_folder_and_runs_there(tmp_path):
    """The shell part of the command, run for real (the runtime itself replaced by echo)."""
    import os
    import subprocess

    script = REPLICA_COMMAND[2].replace("exec python -m gpulab.extensions.runtime", "echo $PWD")
    job_dir = tmp_path / "users" / "ann" / "jobs" / "digits"
    out = subprocess.run(["sh", "-c", script, "gpulab-replica", "/p/train.py", "--x", "a b"],
                         env={**os.environ, "GPULAB_JOB_DIR": str(job_dir)}, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert out == f"{job_dir} /p/train.py --x a b\n" and (job_dir / "logs").is_dir()


def test_job_network_policy_literal():
    replicas = {"matchLabels": {"gpulab.io/user": "ann", "gpulab.io/job": "digits"}}
    assert make_job_network_policy(job="digits", namespace=NS, user_label="ann",
                                   parent_uid="uid-1") == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "digits-replicas", "namespace": NS, "labels": LABELS,
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Service",
                                          "name": "digits", "uid": "uid-1"}]},
        "spec": {"podSelector": replicas, "policyTypes": ["Ingress", "Egress"],
                 "ingress": [{"from": [{"podSelector": replicas}]}],
                 "egress": [{"to": [{"podSelector": replicas}]}]},
    }
    # it selects exactly the pods of the job's role Jobs
    for job in build()[1:]:
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert replicas["matchLabels"].items() <= labels.items()


def test_user_text_reaches_the_replica_unexpanded():
    """args, the program path and env values are escaped: after the kubelet's $(VAR)
    expansion the runtime gets exactly what the person wrote (here: not the TF_CONFIG)."""
    args = ["--out=$(TF_CONFIG)", "$$(GPULAB_JOB_DIR)", "price$", "$(x"]
    spec = {**PS_SPEC, "args": args, "env": {"MODE": "$$(HOME)"}}
    program = "/u/my$(GPULAB_TASK_INDEX).py"  # a script path the person chose
    job = build(spec, program=program)[3]
    tfjob = make_tfjob(parse_spec(spec), Placement(namespace=NS, user_label="ann", image="i",
                                                   program=program, job_dir="/j", user_dir="/u"))
    for pod in (job["spec"]["template"]["spec"],
                tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]):
        (c,) = pod["containers"]
        assert c["command"][len(REPLICA_COMMAND):] == [
            "/u/my$$(GPULAB_TASK_INDEX).py", "--out=$$(TF_CONFIG)", "$$$$(GPULAB_JOB_DIR)",
            "price$$", "$$(x"]
        env = {e["name"]: e.get("value", "") for e in c["env"]}
        env["GPULAB_TASK_INDEX"] = "1"
        assert [kubelet_expand(a, env) for a in c["command"]] == [*REPLICA_COMMAND, program, *args]
        assert kubelet_expand(env["MODE"], env) == "$$(HOME)"


# -- the job as one JobSet (issue 18) ------------------------------------------------------

JOBSET_HOSTS = {
    "chief": ["digits-chief-0-0.digits.gpulab-ann.svc:2222"],
    "ps": ["digits-ps-0-0.digits.gpulab-ann.svc:2222"],
    "worker": ["digits-worker-0-0.digits.gpulab-ann.svc:2222",
               "digits-worker-0-1.digits.gpulab-ann.svc:2222"],
}


def build_jobset(spec=PS_SPEC, queue_name="gpulab", priority_class=None, **kw):
    return make_training_jobset(parse_spec(spec), placement(**kw), queue_name=queue_name,
                                priority_class=priority_class)


def test_a_preemptible_jobset_carries_kueues_priority_class():
    js = build_jobset(priority_class="gpulab-preemptible")
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "gpulab-preemptible"
    assert "kueue.x-k8s.io/priority-class" not in build_jobset()["metadata"]["labels"]


def test_jobset_literal():
    js = build_jobset()
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["kind"] == "JobSet"
    assert js["metadata"] == {"name": "digits", "namespace": NS,
                              "labels": {**LABELS, "kueue.x-k8s.io/queue-name": "gpulab"}}
    spec = js["spec"]
    assert spec["suspend"] is True  # Kueue unsuspends it once admitted whole
    assert spec["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["chief"]}
    assert spec["failurePolicy"] == {"maxRestarts": 3, "rules": [
        {"name": "lostParameterServer", "action": "RestartJobSet",
         "targetReplicatedJobs": ["ps"], "onJobFailureReasons": ["BackoffLimitExceeded"]},
        {"name": "replicaFailed", "action": "FailJobSet"}]}
    assert [(r["name"], r["replicas"]) for r in spec["replicatedJobs"]] == [
        ("chief", 1), ("ps", 1), ("worker", 1)]


def test_a_jobset_role_is_the_same_indexed_job_but_for_its_host_names():
    """Each replicated job's template is the role's Indexed Job of `make_training_job_objects`
    (same pods, retries, failure policy, deadline); only TF_CONFIG's host names differ, and
    the Service's subdomain is JobSet's to set."""
    jobs = {o["metadata"]["name"]: o for o in build()[1:]}
    for rj in build_jobset()["spec"]["replicatedJobs"]:
        plain = jobs[f"digits-{rj['name']}"]
        assert rj["template"]["metadata"] == {"labels": plain["metadata"]["labels"]}
        mine, theirs = rj["template"]["spec"], json.loads(json.dumps(plain["spec"]))
        del theirs["template"]["spec"]["subdomain"]
        for job in (mine, theirs):
            for e in job["template"]["spec"]["containers"][0]["env"]:
                if e["name"] == "TF_CONFIG":
                    e["value"] = "…"
        assert mine == theirs


def test_jobset_tf_config_names_the_pods_jobset_makes():
    """JobSet names the one Job of replicated job <role> `<jobset>-<role>-0` and its Indexed
    pods take the host name `<Job>-<index>` in the JobSet's Service: TF_CONFIG uses them."""
    from gpulab.extensions.runtime import parse_tf_config

    for rj in build_jobset()["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        for i in range(rj["template"]["spec"]["completions"]):
            cfg = json.loads(expand(env["TF_CONFIG"], i))
            assert cfg == {"cluster": JOBSET_HOSTS, "task": {"type": rj["name"], "index": i}}
            host = f"digits-{rj['name']}-{rj['replicas'] - 1}-{i}.digits.gpulab-ann.svc:2222"
            assert host in cfg["cluster"][rj["name"]]
            parse_tf_config(expand(env["TF_CONFIG"], i))


def test_multi_worker_jobset_succeeds_with_its_workers_and_without_a_queue_runs_at_once():
    spec = {"name": "mw", "strategy": "multi-worker-mirrored",
            "replicas": {"worker": 2, "evaluator": 1}, "source": "print(1)",
            "retries": 0}
    js = build_jobset(spec, queue_name=None, shared_volume=None, gpu_model=None)
    assert "kueue.x-k8s.io/queue-name" not in js["metadata"]["labels"]
    assert js["spec"]["suspend"] is False
    assert js["spec"]["successPolicy"] == {"operator": "All",
                                           "targetReplicatedJobs": ["worker"]}
    # no parameter servers: any role's Job that fails for good fails the job
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 0, "rules": [
        {"name": "replicaFailed", "action": "FailJobSet"}]}


def test_the_longest_names_fit_jobsets_pod_name_rule():
    """JobSet's webhook refuses a JobSet whose longest pod name (`<jobset>-<role>-<job
    index>-<pod index>-abcde`) is not a DNS-1035 label: gpulab's longest job name, role and
    replica index fit."""
    from gpulab.hub.jobs.spec import DEFAULT_LIMITS

    name = "a" * DEFAULT_LIMITS.max_name_length
    spec = {"name": name, "strategy": "parameter-server",
            "replicas": {"chief": 1, "ps": 1, "worker": 9, "evaluator": 1}, "script": "t.py"}
    for rj in build_jobset(spec)["spec"]["replicatedJobs"]:
        last = rj["template"]["spec"]["completions"] - 1
        pod = f"{name}-{rj['name']}-{rj['replicas'] - 1}-{last}-abcde"
        assert len(pod) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", pod), pod


def test_the_operators_node_pool_reaches_every_replica_beside_the_gpu_placement():
    """``node_selector`` and ``tolerations`` (KubeSpawner's traits, shared by the job backend)
    go to every pod of both builders; GPU roles keep the model's selector and GPU toleration."""
    pool = {"pool": "training"}
    tol = [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]
    gpu_tol = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    jobs = build(node_selector=pool, tolerations=tol)[1:]
    jobset = build_jobset(node_selector=pool, tolerations=tol)
    pods = {**{j["metadata"]["name"]: j["spec"]["template"]["spec"] for j in jobs},
            **{f"js-{r['name']}": r["template"]["spec"]["template"]["spec"]
               for r in jobset["spec"]["replicatedJobs"]}}
    assert len(pods) == 6
    for name, pod in pods.items():
        if name.endswith("worker"):  # the GPU role
            assert pod["nodeSelector"] == {**pool, "nvidia.com/gpu.product": "NVIDIA-H100"}, name
            assert pod["tolerations"] == [*tol, gpu_tol], name
        else:
            assert pod["nodeSelector"] == pool and pod["tolerations"] == tol, name
    # without them, nothing but the GPU placement (as before)
    plain = {j["metadata"]["name"]: j["spec"]["template"]["spec"] for j in build()[1:]}
    assert "nodeSelector" not in plain["digits-chief"] and "tolerations" not in plain["digits-chief"]
