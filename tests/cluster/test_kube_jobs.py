"""KubeJobBackend against a real control plane, as the hub's ServiceAccount bound by exactly
helm-values/rbac.yaml, with a real quota ledger (SQLite).

This module runs its own control plane: kwok's default Stages (tests/cluster/stages/default.yaml)
complete every Job pod at once, so here they are used without their ``pod-job-done`` stage and
with stages/job-exits.yaml, by which a test ends a replica when it annotates its pod
(``gpulab.test/exit``: ``0``, ``1`` or ``oom``).
"""

import asyncio
import json
import re
import time
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio.config import kube_config
from kubespawner.clients import load_config
from traitlets.config import Config

from gpulab.hub.cli import main as cli_main
from gpulab.hub.jobs.base import JobError
from gpulab.hub.jobs.spec import JobLimits, SpecError, parse_spec
from gpulab.hub.jobs.kube import KubeJobBackend
from gpulab.hub.quota.ledger import Ledger, QuotaExceeded, Request
from gpulab.hub.quota.policy import Quota
from gpulab.hub.cluster.namespaces import GPUQuotaMirror
from tests.app.hubctl import Hub

from . import hubrbac
from .conftest import _build
from .controlplane import _CA, DEFAULT_STAGES, HERE, ControlPlane, free_port

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
TFJOB_CRD = ROOT / "tests" / "reference" / "kubeflow" / "kubeflow.org_tfjobs.yaml"
HUB_NAMESPACE = "gpulab-hub-test"
SHARED = {"nfs": {"server": "nfs.invalid", "path": "/gpulab"}}
REPLICA_LOG = "step 1\nGPULAB_PROGRESS {\"step\": 1, \"total\": 10}\nstep 2\n"
MISSING_IMAGE = "gpulab.test/missing:1"  # stages/job-exits.yaml: its pull fails
LABELS = "app.kubernetes.io/managed-by=gpulab,app.kubernetes.io/component=training-job"


@pytest.fixture(scope="module")
def cp(request, tmp_path_factory):
    """A control plane of its own whose Job pods end only when a test says so."""
    _build(request.config)
    stages = [d for d in yaml.safe_load_all(DEFAULT_STAGES.read_text())
              if d and d["metadata"]["name"] != "pod-job-done"]
    stages += [d for d in yaml.safe_load_all((HERE / "stages" / "job-exits.yaml").read_text()) if d]
    running = next(d for d in stages if d["metadata"]["name"] == "pod-running")
    running["spec"]["selector"]["matchExpressions"].append(
        {"key": ".spec.containers.[].image", "operator": "NotIn", "values": [MISSING_IMAGE]})
    # kwok also serves the pod log API (as a kubelet would) with a fixed log for every
    # training replica, so that logs are read through the API server as on a real cluster
    d = tmp_path_factory.mktemp("kwok")
    (d / "replica.log").write_text("".join(  # the container runtime's (CRI) log format
        f"2026-01-01T00:00:0{i}.000000000Z stdout F {line}\n"
        for i, line in enumerate(REPLICA_LOG.splitlines())))
    stages.append({"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "ClusterLogs",
                   "metadata": {"name": "training-replicas"},
                   "spec": {"selector": {}, "logs": [{"containers": ["tensorflow"],
                                                      "logsFile": str(d / "replica.log")}]}})
    # the API server reaches a node's "kubelet" at its first address (here the node IP only,
    # 127.0.0.1) and its kubelet port (kwok's server)
    port = free_port()
    node_ready = next(d for d in stages if d["metadata"]["name"] == "node-ready")
    template = node_ready["spec"]["next"]["statusTemplate"]
    hostname = "- type: Hostname\n  address: {{ .metadata.name | Quote }}\n"
    assert hostname in template
    node_ready["spec"]["next"]["statusTemplate"] = template.replace(hostname, "") + (
        f"daemonEndpoints:\n  kubeletEndpoint:\n    Port: {port}\n")
    path = d / "stages.yaml"
    path.write_text(yaml.safe_dump_all(stages))
    crt, key = _CA().issue("kwok", server_ips=["127.0.0.1"], client=False, server=True)
    (d / "kwok.crt").write_bytes(crt)
    (d / "kwok.key").write_bytes(key)
    plane = ControlPlane(kwok_stages=[path], kwok_args=[
        "--node-ip=127.0.0.1", f"--node-port={port}", f"--server-address=127.0.0.1:{port}",
        f"--tls-cert-file={d / 'kwok.crt'}", f"--tls-private-key-file={d / 'kwok.key'}"])
    plane.start()
    yield plane
    plane.stop()


@pytest.fixture(scope="module")
def hub_kubeconfig(cp):
    """A kubeconfig of ServiceAccount hub, bound by helm-values/rbac.yaml and nothing else
    (its admission policy too: the hub writes only in namespaces gpulab owns)."""
    return hubrbac.hub_kubeconfig(cp, HUB_NAMESPACE)


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(f"sqlite:///{tmp_path / 'gpulab.sqlite'}", pool="kubernetes")
    led.migrate()
    return led


@pytest.fixture
async def backend(hub_kubeconfig, ledger, monkeypatch):
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", hub_kubeconfig)
    load_config.cache_clear()
    c = Config()
    c.KubeJobBackend.gpu_model = "NVIDIA-H100"
    c.KubeJobBackend.shared_volume = SHARED
    c.KubeJobBackend.reconcile_interval = 0.2
    c.KubeJobBackend.unschedulable_timeout = 4
    c.KubeJobBackend.node_cache_seconds = 0
    b = KubeJobBackend(ledger, config=c)
    b.ensure_supervisor()
    await b.start_watches()
    yield b
    for job in b.list():
        if job["state"] not in ("Succeeded", "Failed", "Stopped"):
            await b.stop(job["user"], job["name"])
    await b.shutdown()
    for mirror in list(GPUQuotaMirror._instances.values()):
        if mirror._task is not None:
            mirror._task.cancel()
    GPUQuotaMirror._instances.clear()


def user():
    return f"u{uuid.uuid4().hex[:6]}"


def get(cp, path):
    status, body = cp.api("GET", path)
    return body if status == 200 else None


def items(cp, ns, what, selector=LABELS):
    group = {"jobs": "/apis/batch/v1", "pods": "/api/v1", "services": "/api/v1",
             "configmaps": "/api/v1", "limitranges": "/api/v1",
             "networkpolicies": "/apis/networking.k8s.io/v1"}[what]
    body = get(cp, f"{group}/namespaces/{ns}/{what}?labelSelector={selector}")
    return body["items"] if body else []


def names(objs):
    return sorted(o["metadata"]["name"] for o in objs)


async def eventually(check, timeout=30, what="a condition"):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.2)


def running_pods(cp, ns, job):
    pods = items(cp, ns, "pods", f"gpulab.io/job={job}")
    return [p for p in pods if p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")]


def pod_of(cp, ns, job, role, index):
    pods = [p for p in running_pods(cp, ns, job)
            if p["metadata"]["labels"]["gpulab.io/role"] == role
            and p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == str(index)]
    return pods[0] if pods else None


def end_pod(cp, pod, code):
    m = pod["metadata"]
    cp.api("PATCH", f"/api/v1/namespaces/{m['namespace']}/pods/{m['name']}",
           {"metadata": {"annotations": {"gpulab.test/exit": str(code)}}},
           content_type="application/merge-patch+json", expect=(200,))


def ps_spec(name, **kw):
    return parse_spec({"name": name, "strategy": "parameter-server",
                       "replicas": {"chief": 1, "ps": 1, "worker": 2},
                       "resources": {"worker": {"gpus": 2}}, "source": "print('hi')", **kw})


def mw_spec(name, workers=2, gpus=1, **kw):
    return parse_spec({"name": name, "strategy": "multi-worker-mirrored",
                       "replicas": {"worker": workers}, "resources": {"worker": {"gpus": gpus}},
                       "script": "train.py", **kw})


async def test_submit_creates_the_objects_runs_on_h100_and_chief_completion_succeeds(
        cp, backend, ledger):
    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=8), actor="admin")
    before = backend.api_requests
    job = await backend.submit(u, (), ps_spec("digits"))
    ns = job["namespace"]
    assert ns == f"gpulab-{u}" and job["state"] == "Admitted" and job["gpus"] == 4
    # roles (3) + Service + NetworkPolicy + ConfigMap (source) + the user's namespace, its two
    # NetworkPolicies, its default ServiceAccount and its quota (the first job of a user) +
    # the nodes (listed every time here: node_cache_seconds = 0)
    assert backend.api_requests - before == 3 + 9
    # the operator's container defaults (issue 36) are in every replica's template (below:
    # in the pods), not in a LimitRange of the namespace (one request fewer, issue 40)
    assert items(cp, ns, "limitranges", "app.kubernetes.io/managed-by=gpulab") == []

    # exactly the expected objects, all owned by the Service
    svc = items(cp, ns, "services")
    assert names(svc) == ["digits"] and svc[0]["spec"]["clusterIP"] == "None"
    jobs = items(cp, ns, "jobs")
    assert names(jobs) == ["digits-chief", "digits-ps", "digits-worker"]
    assert names(items(cp, ns, "configmaps")) == ["digits-source"]
    # the job's NetworkPolicy (its replicas reach each other, nothing else reaches them), and
    # the namespace's own, made before the namespace's first replica
    [policy] = items(cp, ns, "networkpolicies")
    assert policy["metadata"]["name"] == "digits-replicas"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == svc[0]["metadata"]["uid"]
    replicas = {"matchLabels": {"gpulab.io/user": u, "gpulab.io/job": "digits"}}
    assert policy["spec"] == {"podSelector": replicas, "policyTypes": ["Ingress", "Egress"],
                              "ingress": [{"from": [{"podSelector": replicas}]}],
                              "egress": [{"to": [{"podSelector": replicas}]}]}
    assert names(items(cp, ns, "networkpolicies", "app.kubernetes.io/managed-by=gpulab")) == [
        "digits-replicas", "gpulab-servers", "gpulab-user-pods"]
    for j in jobs:
        assert [o["uid"] for o in j["metadata"]["ownerReferences"]] == [svc[0]["metadata"]["uid"]]
        assert j["spec"]["completionMode"] == "Indexed"
    worker = next(j for j in jobs if j["metadata"]["name"] == "digits-worker")
    env = {e["name"]: e.get("value") for e in worker["spec"]["template"]["spec"]["containers"][0]["env"]}
    tf_config = json.loads(env["TF_CONFIG"].replace("$(GPULAB_TASK_INDEX)", "1"))
    assert tf_config == {
        "cluster": {"chief": [f"digits-chief-0.digits.{ns}.svc:2222"],
                    "ps": [f"digits-ps-0.digits.{ns}.svc:2222"],
                    "worker": [f"digits-worker-0.digits.{ns}.svc:2222",
                               f"digits-worker-1.digits.{ns}.svc:2222"]},
        "task": {"type": "worker", "index": 1}}

    # the scheduler places GPU replicas on H100 nodes, kwok runs them; hosts match TF_CONFIG
    await eventually(lambda: len(running_pods(cp, ns, "digits")) == 4, what="4 running pods")
    for p in running_pods(cp, ns, "digits"):
        labels = p["metadata"]["labels"]
        host = f"{labels['gpulab.io/role']}-{labels['batch.kubernetes.io/job-completion-index']}"
        assert p["spec"]["hostname"] == f"digits-{host}" and p["spec"]["subdomain"] == "digits"
        if labels["gpulab.io/role"] == "worker":
            assert p["spec"]["nodeName"].startswith("gpu-h100-")
        else:
            assert p["spec"]["nodeName"] == "cpu-0"
        # every replica whose role names no CPU, memory or ephemeral storage gets the
        # defaults, so none runs unbounded
        resources = p["spec"]["containers"][0]["resources"]
        assert {k: v for k, v in resources["limits"].items() if k != "nvidia.com/gpu"} == {
            "cpu": "2", "memory": "8Gi", "ephemeral-storage": "20Gi"}, resources
        assert {k: v for k, v in resources["requests"].items() if k != "nvidia.com/gpu"} == {
            "cpu": "100m", "memory": "512Mi", "ephemeral-storage": "1Gi"}, resources
    view = await eventually(lambda: (lambda v: v if v["state"] == "Running" else None)(
        backend.get(u, "digits")), what="the job Running")
    assert {r["name"]: r["state"] for r in view["replicas"]} == {
        "chief-0": "Running", "ps-0": "Running", "worker-0": "Running", "worker-1": "Running"}

    # logs through the pod log API, from an offset
    text, size, done = await backend.read_log(u, "digits", "worker-1")
    assert (text.decode(), size, done) == (REPLICA_LOG, len(REPLICA_LOG), False)
    text, size, _ = await backend.read_log(u, "digits", "worker-1", offset=7)
    assert text.decode() == REPLICA_LOG[7:] and size == len(REPLICA_LOG)

    # progress comes from the chief's log, read only when someone looks at this job (the
    # lists and the reconciler read no log), then reused for progress_cache_seconds
    assert view["progress"] is None
    before = backend.api_requests
    assert (await backend.detail(u, "digits"))["progress"] == {"step": 1, "total": 10}
    assert (await backend.detail(u, "digits"))["progress"] == {"step": 1, "total": 10}
    assert backend.api_requests - before == 1
    assert await backend.detail(user(), "digits") is None

    # the chief finishes: the job succeeds, ps and workers are removed, the GPUs released
    end_pod(cp, pod_of(cp, ns, "digits", "chief", 0), 0)
    view = await eventually(lambda: (lambda v: v if v["state"] == "Succeeded" else None)(
        backend.get(u, "digits")), what="the job Succeeded")
    assert view["reason"] == "the chief finished"
    await eventually(lambda: names(items(cp, ns, "jobs")) == ["digits-chief"],
                     what="ps and worker Jobs deleted")
    await eventually(lambda: {p["metadata"]["labels"]["gpulab.io/role"]
                              for p in items(cp, ns, "pods", "gpulab.io/job=digits")} == {"chief"},
                     what="ps and worker pods gone")
    assert ledger.open_allocations(user=u) == []
    # the finished job keeps its last progress
    assert (await backend.detail(u, "digits"))["progress"] == {"step": 1, "total": 10}


async def test_a_failed_worker_is_retried_and_all_workers_finishing_succeeds(cp, backend, ledger):
    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=8), actor="admin")
    job = await backend.submit(u, (), mw_spec("mw", retries=2))
    ns = job["namespace"]
    await eventually(lambda: len(running_pods(cp, ns, "mw")) == 2, what="2 running workers")
    end_pod(cp, pod_of(cp, ns, "mw", "worker", 1), 1)
    view = await eventually(lambda: (lambda v: v if v["replicas"][1]["restarts"] == 1 else None)(
        backend.get(u, "mw")), what="worker-1 failed once")
    assert view["state"] in ("Starting", "Running")
    # the Job controller makes a new pod for index 1 (after its back-off of about 10 s)
    await eventually(lambda: len(running_pods(cp, ns, "mw")) == 2, timeout=45,
                     what="worker-1 replaced")
    view = await eventually(lambda: (lambda v: v if v["state"] == "Running" else None)(
        backend.get(u, "mw")), what="the job Running again")
    assert view["replicas"][1]["restarts"] == 1
    for p in running_pods(cp, ns, "mw"):
        end_pod(cp, p, 0)
    view = await eventually(lambda: (lambda v: v if v["state"] == "Succeeded" else None)(
        backend.get(u, "mw")), what="the job Succeeded")
    assert view["reason"] == "all workers finished"
    assert ledger.open_allocations(user=u) == []


async def test_a_held_cluster_without_kueue_serves_its_kernel_and_a_lost_ps_ends_it(
        cp, backend, ledger):
    """A cluster (issue 38) as Indexed Jobs under the headless Service (no Kueue): the ledger
    admits its GPUs whole, its pods answer to the addresses of its view, its policies go
    with its Service; a ps that fails is not replaced and ends the cluster in words."""
    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=8), actor="admin")
    spec = parse_spec({"name": "held", "kind": "cluster", "strategy": "parameter-server",
                       "replicas": {"ps": 1, "worker": 2}, "resources": {"worker": {"gpus": 1}}})
    job = await backend.submit(u, (), spec)
    ns = job["namespace"]
    assert [a.gpus for a in ledger.open_allocations(user=u)] == [2]
    view = await eventually(lambda: (lambda v: v if v["state"] == "Running" else None)(
        backend.get(u, "held")), what="the cluster Running")
    pods = running_pods(cp, ns, "held")
    assert {f"{p['spec']['hostname']}.{p['spec']['subdomain']}.{ns}.svc:2222" for p in pods} == {
        *view["cluster"]["ps"], *view["cluster"]["worker"]}
    assert names(items(cp, ns, "networkpolicies", "gpulab.io/job=held")) == [
        "held-coordinator", "held-replicas"]
    end_pod(cp, pod_of(cp, ns, "held", "ps", 0), 1)
    view = await eventually(lambda: (lambda v: v if v["state"] == "Failed" else None)(
        backend.get(u, "held")), what="the cluster Failed")
    assert view["reason"].startswith("parameter server ps-0 was lost"), view["reason"]
    assert ledger.open_allocations(user=u) == []


async def test_out_of_retries_fails_the_job_with_the_reason(cp, backend, ledger):
    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=8), actor="admin")
    job = await backend.submit(u, (), mw_spec("oom", workers=1, retries=0))
    ns = job["namespace"]
    await eventually(lambda: running_pods(cp, ns, "oom"), what="a running worker")
    end_pod(cp, pod_of(cp, ns, "oom", "worker", 0), "oom")
    view = await eventually(lambda: (lambda v: v if v["state"] == "Failed" else None)(
        backend.get(u, "oom")), what="the job Failed")
    assert "retries are used up" in view["reason"] and "out of memory" in view["reason"]
    assert ledger.open_allocations(user=u) == []


async def test_a_chief_failing_with_its_own_error_fails_the_job_at_once(cp, backend, ledger):
    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=8), actor="admin")
    job = await backend.submit(u, (), ps_spec("crash", retries=5))
    ns = job["namespace"]
    await eventually(lambda: len(running_pods(cp, ns, "crash")) == 4, what="4 running pods")
    end_pod(cp, pod_of(cp, ns, "crash", "chief", 0), 1)
    view = await eventually(lambda: (lambda v: v if v["state"] == "Failed" else None)(
        backend.get(u, "crash")), what="the job Failed")
    assert view["reason"] == ("chief-0 failed: the program raised an error (exit 1); this is "
                              "not retried (see its log: gpulab jobs logs crash chief-0)")
    await eventually(lambda: names(items(cp, ns, "jobs")) == ["crash-chief"],
                     what="ps and worker Jobs deleted")
    assert ledger.open_allocations(user=u) == []


async def test_a_restarted_service_picks_its_running_jobs_up(cp, backend, ledger):
    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=8), actor="admin")
    job = await backend.submit(u, (), mw_spec("survivor", workers=2))
    ns = job["namespace"]
    await eventually(lambda: (lambda v: v if v["state"] == "Running" else None)(
        backend.get(u, "survivor")), what="the job Running")
    await backend.shutdown()  # the service goes away; the job runs on
    again = KubeJobBackend(ledger, config=backend.config)
    again.recover()
    assert [a.holder for a in ledger.open_allocations(user=u)] == ["survivor"]
    again.ensure_supervisor()
    try:
        for p in running_pods(cp, ns, "survivor"):
            end_pod(cp, p, 0)
        view = await eventually(lambda: (lambda v: v if v["state"] == "Succeeded" else None)(
            again.get(u, "survivor")), what="the job Succeeded")
        assert view["reason"] == "all workers finished"
        assert ledger.open_allocations(user=u) == []
    finally:
        await again.shutdown()


async def test_stop_removes_every_object(cp, backend, ledger):
    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=8), actor="admin")
    job = await backend.submit(u, (), ps_spec("stopme"))
    ns = job["namespace"]
    await eventually(lambda: len(running_pods(cp, ns, "stopme")) == 4, what="4 running pods")
    view = await backend.stop(u, "stopme", actor="admin")
    assert view["state"] == "Stopped" and view["reason"] == "stopped by admin"
    assert ledger.open_allocations(user=u) == []
    for what in ("services", "jobs", "configmaps", "networkpolicies", "pods"):  # garbage collection
        await eventually(lambda: items(cp, ns, what) == [], what=f"no {what} left")


async def test_a_persons_active_replicas_are_bounded(cp, backend, ledger, monkeypatch):
    """GPU-less jobs pass every GPU quota: ``c.GPUJobs.max_replicas_per_user`` bounds them,
    and a job over the bound is refused whole, before anything reaches the cluster."""
    from dataclasses import replace

    monkeypatch.setattr(backend, "limits", replace(backend.limits, max_replicas_per_user=5))
    u = user()
    job = await backend.submit(u, (), mw_spec("first", workers=3, gpus=0))
    ns = job["namespace"]
    with pytest.raises(JobError) as refused:
        await backend.submit(u, (), mw_spec("second", workers=3, gpus=0))
    assert refused.value.status == 409 and refused.value.field == "replicas"
    assert "3 are active now" in refused.value.message
    assert backend.get(u, "second") is None
    assert [j["metadata"]["name"] for j in items(cp, ns, "jobs")
            if "second" in j["metadata"]["name"]] == []
    # another person is not bound by this one's jobs
    other = await backend.submit(user(), (), mw_spec("second", workers=3, gpus=0))
    assert other["state"] != "Failed"


async def test_a_notebook_and_a_job_share_one_quota(cp, backend, ledger):
    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=2), actor="admin")
    ledger.admit(Request(user=u, kind="notebook", holder="", gpus=1))  # a 1-GPU notebook runs
    with pytest.raises(QuotaExceeded) as e:
        await backend.submit(u, (), mw_spec("big", workers=1, gpus=2))
    assert "2 GPUs" in e.value.message and "1 of your 2 GPUs is in use" in e.value.message
    ns = backend.namespace_of(u)
    for what in ("services", "jobs", "configmaps", "pods"):
        assert items(cp, ns, what, "gpulab.io/job=big") == []
    assert backend.get(u, "big") is None
    assert [a.kind for a in ledger.open_allocations(user=u)] == ["notebook"]


async def test_capacity_and_unschedulable_replicas(cp, backend, ledger):
    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=64), actor="admin")
    # 4 replicas of 8 H100s can never fit on 3 nodes of 8: refused before the cluster
    with pytest.raises(JobError) as e:
        await backend.submit(u, (), mw_spec("huge", workers=4, gpus=8))
    assert e.value.status == 409 and "cannot hold this job" in e.value.message
    assert items(cp, backend.namespace_of(u), "jobs") == []
    # three 8-GPU workers fill the H100 nodes; one more replica cannot be scheduled and its
    # whole job is removed after the timeout, with the reason in words
    await backend.submit(u, (), mw_spec("fill", workers=3, gpus=8))
    ns = backend.namespace_of(u)
    await eventually(lambda: len(running_pods(cp, ns, "fill")) == 3, what="3 running workers")
    await backend.submit(u, (), mw_spec("late", workers=2, gpus=4))
    view = await eventually(lambda: (lambda v: v if v["state"] == "Failed" else None)(
        backend.get(u, "late")), timeout=30, what="the late job removed")
    assert re.search(r"worker-\d cannot be scheduled: no node has 4 free GPUs of model "
                     r"NVIDIA-H100 within 4 s; the whole job was removed", view["reason"]), view
    for what in ("services", "jobs", "pods"):
        await eventually(lambda: items(cp, ns, what, "gpulab.io/job=late") == [],
                         what=f"no {what} of the late job")
    assert [a.holder for a in ledger.open_allocations(user=u)] == ["fill"]


async def test_a_pod_the_namespace_quota_refuses_removes_the_job(cp, backend, ledger):
    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=8), actor="admin")
    await backend.submit(u, (), mw_spec("first", workers=1, gpus=0))  # prepares the namespace
    ns = backend.namespace_of(u)
    # someone shrinks the namespace's ResourceQuota behind the ledger's back
    cp.api("PATCH", f"/api/v1/namespaces/{ns}/resourcequotas/gpulab-gpus",
           {"spec": {"hard": {"requests.nvidia.com/gpu": "0"}}},
           content_type="application/merge-patch+json", expect=(200,))
    await backend.submit(u, (), mw_spec("refused", workers=1, gpus=1))
    view = await eventually(lambda: (lambda v: v if v["state"] == "Failed" else None)(
        backend.get(u, "refused")), timeout=30, what="the refused job removed")
    assert view["reason"].startswith("worker-0: the cluster made no pod within 4 s (the "
                                     "namespace's GPU quota or a policy refuses it"), view
    for what in ("services", "jobs", "networkpolicies"):
        await eventually(lambda: items(cp, ns, what, "gpulab.io/job=refused") == [],
                         what=f"no {what} of the refused job")
    assert [a.holder for a in ledger.open_allocations(user=u)] == ["first"]


async def test_an_image_that_cannot_be_pulled_is_said_in_words(cp, backend, ledger):
    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=8), actor="admin")
    spec = parse_spec({"name": "img", "strategy": "multi-worker-mirrored", "script": "t.py",
                       "image": MISSING_IMAGE}, JobLimits(allowed_images=(MISSING_IMAGE,)))
    await backend.submit(u, (), spec)
    # the job is Starting once its pod exists; the kubelet's pull fails a moment later
    view = await eventually(lambda: (lambda v: v if v["state"] == "Starting"
                                     and v["replicas"][0]["reason"] != "starting" else None)(
        backend.get(u, "img")), what="the job Starting, its pull failed")
    assert view["replicas"][0]["reason"] == (
        f"the image {MISSING_IMAGE} cannot be pulled (ErrImagePull)")
    assert view["reason"] == f"worker-0: the image {MISSING_IMAGE} cannot be pulled (ErrImagePull)"


async def test_users_are_kept_apart_and_bad_specs_never_reach_the_cluster(cp, backend, ledger):
    ann, bob = user(), user()
    for u in (ann, bob):
        ledger.set_quota("user", u, Quota(max_gpus=4), actor="admin")
    await backend.submit(ann, (), mw_spec("mine"))
    assert backend.get(bob, "mine") is None
    assert [j["name"] for j in backend.list(bob)] == []
    with pytest.raises(JobError) as e:
        await backend.stop(bob, "mine")
    assert e.value.status == 404
    with pytest.raises(JobError):
        await backend.read_log(bob, "mine", "worker-0")
    assert backend.get(ann, "mine")["state"] != "Stopped"
    # bob's job of the same name lives in bob's namespace, apart from ann's
    job = await backend.submit(bob, (), mw_spec("mine"))
    assert job["namespace"] == f"gpulab-{bob}" != backend.get(ann, "mine")["namespace"]
    # the spec has no way to name a namespace, privileges, host paths or another image
    base = {"name": "evil", "strategy": "multi-worker-mirrored", "script": "t.py"}
    for extra in ({"namespace": f"gpulab-{ann}"}, {"privileged": True},
                  {"volumes": [{"hostPath": {"path": "/"}}]}, {"image": "evil:latest"},
                  {"env": {"GPULAB_JOB_DIR": "/"}}):
        with pytest.raises(SpecError):
            parse_spec({**base, **extra}, JobLimits(allowed_images=("gpulab/singleuser:1",)))
    assert items(cp, f"gpulab-{bob}", "jobs", "gpulab.io/job=evil") == []
    # the hub's own identity cannot make privileged pods in a user namespace either (Pod
    # Security baseline is enforced on the namespaces the backend prepares)
    ns = backend.namespace_of(ann)
    assert get(cp, f"/api/v1/namespaces/{ns}")["metadata"]["labels"][
        "pod-security.kubernetes.io/enforce"] == "baseline"


async def test_exported_tfjobs_are_valid_against_the_kubeflow_crd(cp, tmp_path, capsys):
    crd = yaml.safe_load(TFJOB_CRD.read_text())
    cp.apply(crd)
    await eventually(lambda: (lambda c: c and any(
        x["type"] == "Established" and x["status"] == "True"
        for x in (c.get("status") or {}).get("conditions") or []))(
        get(cp, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/tfjobs.kubeflow.org")),
        what="the TFJob CRD established")
    ns = f"t-{uuid.uuid4().hex[:6]}"
    cp.create_namespace(ns)
    # as a person would: gpulab jobs export --format tfjob ... | kubectl create -f -
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({
        "name": "ev", "strategy": "parameter-server",
        "replicas": {"chief": 1, "ps": 2, "worker": 2, "evaluator": 1},
        "resources": {"worker": {"gpus": 1, "cpu": 2, "memory": "4Gi"}},
        "script": "t.py", "max_runtime": 600}))
    (tmp_path / "t.py").write_text("print('hi')\n")
    common = ["--namespace", ns, "--user", "ann", "--gpu-model", "NVIDIA-H100",
              "--nfs", "nfs.invalid:/gpulab"]
    exports = [[str(spec_file)],
               ["--name", "mw-export", "--strategy", "multi-worker-mirrored", "--workers", "3",
                "--gpus", "2", "--source-file", str(tmp_path / "t.py")],
               ["--name", "ps-export", "--strategy", "parameter-server", "--workers", "2",
                "--script", "t.py", "--retries", "5"]]
    for argv in exports:
        assert cli_main(["jobs", "export", "--format", "tfjob", *argv, *common]) == 0
        docs = list(yaml.safe_load_all(capsys.readouterr().out))
        for doc in docs:
            path = ("/api/v1/namespaces/{}/configmaps" if doc["kind"] == "ConfigMap"
                    else "/apis/kubeflow.org/v1/namespaces/{}/tfjobs").format(ns)
            status, body = cp.api("POST", f"{path}?fieldValidation=Strict", doc)
            assert status == 201, body
        tfjob = docs[-1]
    assert sorted(names(get(cp, f"/apis/kubeflow.org/v1/namespaces/{ns}/tfjobs")["items"])) == [
        "ev", "mw-export", "ps-export"]
    # the schema refuses what the operator would not understand (it does validate)
    bad = json.loads(json.dumps(tfjob))
    bad["metadata"]["name"] = "bad"
    bad["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] = "many"
    status, body = cp.api("POST", f"/apis/kubeflow.org/v1/namespaces/{ns}/tfjobs", bad)
    assert status == 422, body


# -- the jobs API over HTTP, with this backend ---------------------------------------------


@pytest.fixture(scope="module")
def hub(workdir, prefix, cp, hub_kubeconfig):
    """`gpulab up` whose gpulab service runs training jobs on this control plane (the
    service's backend chosen as on Kubernetes, by its environment; the operator's settings
    file adds those variables), so that users call the jobs API through the hub as they do
    in a z2jh deployment. Its ledger is the local hub's (4 simulated GPUs)."""
    settings = {"gpu_model": "NVIDIA-H100", "shared_volume": SHARED, "reconcile_interval": 0.2}
    env = {"GPULAB_JOB_BACKEND": "kubernetes", "GPULAB_KUBE_JOBS": json.dumps(settings),
           "KUBECONFIG": str(hub_kubeconfig)}
    data = workdir / "data"
    data.mkdir(mode=0o700)
    (data / "gpulab_config.py").write_text(
        f"c.JupyterHub.services = [{{'name': 'gpulab', 'environment': {env!r}}}]\n")
    (data / "gpulab_config.py").chmod(0o600)
    h = Hub(data, "--simulated-gpus", "4", "--user-prefix", prefix).start()
    yield h
    h.stop()


async def test_over_http_users_cannot_see_stop_or_read_each_others_jobs(cp, hub, users, admin):
    ann, bob = users["ann"], users["bob"]
    spec = {"name": "apart", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
            "resources": {"worker": {"gpus": 1}}, "source": "print('hi')"}
    r = ann.service("POST", "jobs", json=spec)
    assert r.status_code == 201, r.text
    job = r.json()
    ns = job["namespace"]
    assert job["backend"] == "kubernetes" and ns == "gpulab-ann"
    await eventually(lambda: len(running_pods(cp, ns, "apart")) == 1, what="ann's replica")

    # bob sees nothing of it, and can neither stop it nor read its log
    assert bob.service("GET", "jobs").json()["jobs"] == []
    for method, path in (("GET", "jobs/apart"), ("POST", "jobs/apart/stop"),
                         ("GET", "jobs/apart/logs/worker-0")):
        r = bob.service(method, path)
        assert r.status_code == 404 and "ann" not in r.text, (method, path, r.text)
        r = bob.service(method, path + "?user=ann")
        assert r.status_code == 403, (method, path, r.text)
    assert bob.service("GET", "jobs?user=ann").status_code == 403
    # nor make one in ann's namespace, privileged, or with host paths: refused before the cluster
    for extra, field in (({"namespace": "gpulab-ann"}, "namespace"), ({"privileged": True}, "privileged"),
                         ({"volumes": [{"hostPath": {"path": "/"}}]}, "volumes")):
        r = bob.service("POST", "jobs", json={**spec, "name": "evil", **extra})
        assert r.status_code == 400 and r.json()["field"] == field, r.text
    assert items(cp, "gpulab-ann", "jobs", "gpulab.io/job=evil") == []
    assert get(cp, "/api/v1/namespaces/gpulab-bob") is None  # nothing was made for bob

    # ann sees it whole: state, progress and log from the pod log API; an admin may look too
    view = await eventually(lambda: (lambda v: v if v["state"] == "Running" else None)(
        ann.service("GET", "jobs/apart").json()), what="Running through the API")
    assert view["progress"] == {"step": 1, "total": 10}
    assert ann.service("GET", "jobs/apart/logs/worker-0").json()["text"] == REPLICA_LOG
    assert admin.service("GET", "jobs/apart?user=ann").json()["id"] == job["id"]
    # and stops it: every object goes
    r = ann.service("POST", "jobs/apart/stop")
    assert r.status_code == 200 and r.json()["state"] == "Stopped", r.text
    await eventually(lambda: not items(cp, ns, "jobs", "gpulab.io/job=apart")
                     and not items(cp, ns, "services", "gpulab.io/job=apart"),
                     what="ann's job's objects deleted")
    assert ann.service("GET", "me").json()["holdings"] == []


async def test_dcgm_figures_of_the_replicas_pods_are_labelled_by_their_job(cp, backend, ledger):
    """GPU telemetry on Kubernetes (issue 39): a stand-in DCGM exporter (a tiny HTTP server)
    serves the recorded page's format with the pods the real Job controller made for a
    job's replicas, and a GPU of another namespace; the service's usage (`usage_from_env`,
    DCGM source, as `gpulab up` on a cluster configures it) labels each GPU by its pod's
    owner: the job's allocation gets exactly its replicas' GPUs."""
    import http.server
    import threading

    from gpulab.hub.service.app import usage_from_env

    u = user()
    ledger.set_quota("user", u, Quota(max_gpus=2), actor="admin")
    job = await backend.submit(u, (), mw_spec("dcgm", workers=2, gpus=1))
    ns = job["namespace"]
    pods = await eventually(lambda: (lambda p: p if len(p) == 2 else None)(
        running_pods(cp, ns, "dcgm")), what="2 running replica pods")
    lines = []
    for i, (pod_ns, pod, util) in enumerate([(ns, p["metadata"]["name"], 40 + i)
                                             for i, p in enumerate(pods)]
                                            + [("gpulab-someone", "jupyter-someone", 99)]):
        labels = (f'gpu="{i}",UUID="GPU-{i:04d}",device="nvidia{i}",modelName="NVIDIA H100",'
                  f'Hostname="node-{i}",container="tensorflow",namespace="{pod_ns}",pod="{pod}"')
        lines += [f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} {util}",
                  f"DCGM_FI_DEV_FB_USED{{{labels}}} 2048", f"DCGM_FI_DEV_FB_FREE{{{labels}}} 79000"]
    page = ("# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n" + "\n".join(lines) + "\n").encode()

    class Exporter(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Exporter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    usage = usage_from_env(ledger, interval=0.1, source=json.dumps(
        {"source": "dcgm", "dcgm_url": f"http://127.0.0.1:{server.server_port}/metrics"}),
        kube_jobs=json.dumps({"namespace_template": "gpulab-{username}"}))
    try:
        await asyncio.to_thread(usage.sampler.wait_first, 10)
        allocs = ledger.open_allocations()
        [mine] = [a for a in allocs if a.user == u and a.holder == "dcgm"]
        entries = usage.entries_for(mine, allocs)
        assert sorted((e["pod"], e["gpu_percent"]) for e in entries) == sorted(
            (p["metadata"]["name"], 40 + i) for i, p in enumerate(pods))
        assert all(e["namespace"] == ns and "busy, 2.0 of 79.1 GiB" in e["text"] for e in entries)
    finally:
        usage.close()
        server.shutdown()
        server.server_close()
