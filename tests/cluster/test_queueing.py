"""Kueue and JobSet on the test control plane (``ControlPlane(queueing=True)``): a JobSet is
admitted whole by quota or waits suspended without a pod; a notebook pod waits gated.

Each test has a ClusterQueue of its own (4 H100 GPUs, one ResourceFlavor for
``nvidia.com/gpu.product=NVIDIA-H100``) and a LocalQueue in a fresh namespace. kwok runs the
pods and keeps them Running (no Stage ends them), so quota frees only when a test deletes.

The last tests (issue 18's first step) use gpulab's own builders instead: the Kueue objects of
two people's quotas (`gpulab.hub.cluster.kueueobjects`, 2 GPUs each, borrowed from the root
cohort's pool of 4) and
training jobs as JobSets (`gpulab.hub.jobs.kubeobjects.make_training_jobset`): the webhooks
accept them, a job is admitted whole and its pods answer to the host names in TF_CONFIG, one
over the person's quota waits without a pod, another namespace cannot use a person's
ClusterQueue, and preemptible work borrows the idle pool and is preempted (a lower priority)
when someone's in-quota work needs it.

The last tests run gpulab's job backend with Kueue (``c.KubeJobBackend.kueue``) as the hub's
ServiceAccount bound by helm-values/rbac.yaml: its quota mirror makes the person's Kueue
objects from the ledger, jobs wait whole and start by themselves, the ledger follows Kueue's
admissions, an admin's quota edit reaches the ClusterQueue, a used-up budget holds
admissions across a service restart, and preemptible jobs are preempted and requeued.
"""

import json
import uuid

import pytest
import yaml

from gpulab.hub.cluster.kueueobjects import QUOTA_RESOURCE

from .conftest import _build
from .controlplane import (
    DEFAULT_STAGES,
    HERE,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    GPU_TOLERATION,
    ControlPlane,
    wait_until,
)
from .queueing import (
    QUEUE_NAME_LABEL,
    kueue_configuration,
    kustomize_crds,
    kustomize_webhooks,
    loopback_webhooks,
    manager_rbac,
)

pytestmark = pytest.mark.cluster

IMAGE = "registry.invalid/gpulab/never-pulled:1"  # kwok runs no containers
FLAVOR = "nvidia-h100"
GPUS_PER_QUEUE = 4
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
WAIT = 60


def queueing_plane(request, tmp_path_factory, **kwargs) -> ControlPlane:
    """A started control plane of its own with Kueue and JobSet (``kwargs``: ControlPlane's),
    whose pods run until deleted, or until a test ends a replica by annotating its pod
    (``gpulab.test/exit``: 0, 1 or oom)."""
    _build(request.config)
    stages = [d for d in yaml.safe_load_all(DEFAULT_STAGES.read_text())
              if d and d["metadata"]["name"] != "pod-job-done"]
    stages += [d for d in yaml.safe_load_all((HERE / "stages" / "job-exits.yaml").read_text()) if d]
    path = tmp_path_factory.mktemp("kwok") / "stages.yaml"
    path.write_text(yaml.safe_dump_all(stages))
    plane = ControlPlane(queueing=True, kwok_stages=[path], **kwargs)
    plane.start()
    return plane


@pytest.fixture(scope="module")
def cp(request, tmp_path_factory):
    """A control plane of its own with Kueue and JobSet, whose pods run until deleted."""
    plane = queueing_plane(request, tmp_path_factory)
    print(f"control plane with Kueue and JobSet up in {plane.startup_seconds:.1f}s ({plane.dir})")
    plane.apply({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": FLAVOR},
        "spec": {"nodeLabels": {GPU_PRODUCT_LABEL: "NVIDIA-H100"}, "tolerations": [dict(GPU_TOLERATION)]},
    })
    yield plane
    plane.stop()


@pytest.fixture
def queue(cp):
    """(namespace, LocalQueue name): a ClusterQueue of GPUS_PER_QUEUE H100s for one namespace."""
    ns = f"q-{uuid.uuid4().hex[:8]}"
    cp.create_namespace(ns)
    cq = f"cq-{ns}"
    cp.apply(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cq},
            "spec": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "resourceGroups": [{
                    "coveredResources": ["cpu", "memory", GPU_RESOURCE],
                    "flavors": [{"name": FLAVOR, "resources": [
                        {"name": "cpu", "nominalQuota": "32"},
                        {"name": "memory", "nominalQuota": "128Gi"},
                        {"name": GPU_RESOURCE, "nominalQuota": str(GPUS_PER_QUEUE)},
                    ]}],
                }],
            },
        },
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": "team", "namespace": ns}, "spec": {"clusterQueue": cq}},
    )
    wait_until(lambda: condition(cp.kubectl_json("get", "clusterqueue", cq), "Active") == "True",
               timeout=WAIT, what=f"ClusterQueue {cq} Active")
    wait_until(lambda: condition(cp.kubectl_json("get", "localqueue", "team", "-n", ns), "Active") == "True",
               timeout=WAIT, what=f"LocalQueue {ns}/team Active")
    yield ns, "team"
    cp.kubectl("delete", "jobsets,pods", "--all", "-n", ns, "--wait=false", check=False)
    cp.api("DELETE", f"/api/v1/namespaces/{ns}")
    cp.kubectl("delete", "clusterqueue", cq, "--wait=false", check=False)


def condition(obj, type_):
    c = next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), None)
    return c and c["status"]


def container(gpus):
    return {
        "name": "main",
        "image": IMAGE,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi", GPU_RESOURCE: str(gpus)}},
    }


def jobset(name, queue_name, *, workers, gpus):
    """A JobSet of one replicated Job "worker" x ``workers``, each one pod of ``gpus`` GPUs."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "labels": {QUEUE_NAME_LABEL: queue_name}},
        "spec": {
            "replicatedJobs": [{
                "name": "worker",
                "replicas": workers,
                "template": {"spec": {
                    "parallelism": 1, "completions": 1, "backoffLimit": 0,
                    "template": {"spec": {
                        "restartPolicy": "Never",
                        "containers": [container(gpus)],
                        "tolerations": [dict(GPU_TOLERATION)],
                    }},
                }},
            }],
        },
    }


def notebook_pod(name, queue_name, *, gpus):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {QUEUE_NAME_LABEL: queue_name}},
        "spec": {"containers": [container(gpus)], "tolerations": [dict(GPU_TOLERATION)]},
    }


def create(cp, ns, obj):
    cp.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))


def workload_of(cp, ns, kind, name):
    """The Workload Kueue made for object ``kind/name`` (None before it exists)."""
    for w in cp.kubectl_json("get", "workloads.kueue.x-k8s.io", "-n", ns)["items"]:
        if any(o["kind"] == kind and o["name"] == name for o in w["metadata"].get("ownerReferences", [])):
            return w
    return None


def admitted(cp, ns, kind, name):
    w = workload_of(cp, ns, kind, name)
    return w if w and condition(w, "Admitted") == "True" else None


def jobset_pods(cp, ns, name):
    return cp.kubectl_json("get", "pods", "-n", ns, "-l", f"{JOBSET_LABEL}={name}")["items"]


def running_on_h100(cp, pods):
    nodes = {n["metadata"]["name"]: n for n in cp.kubectl_json("get", "nodes")["items"]}
    return all(
        p["status"].get("phase") == "Running"
        and nodes[p["spec"]["nodeName"]]["metadata"]["labels"].get(GPU_PRODUCT_LABEL) == "NVIDIA-H100"
        for p in pods
    )


def wait_jobset_running(cp, ns, name, workers):
    w = wait_until(lambda: admitted(cp, ns, "JobSet", name), timeout=WAIT, what=f"JobSet {ns}/{name} admitted")
    js = cp.kubectl_json("get", "jobset", name, "-n", ns)
    wait_until(lambda: cp.kubectl_json("get", "jobset", name, "-n", ns)["spec"].get("suspend") is False,
               timeout=WAIT, what=f"JobSet {ns}/{name} unsuspended")
    pods = wait_until(
        lambda: (p := jobset_pods(cp, ns, name)) and len(p) == workers and running_on_h100(cp, p) and p,
        timeout=WAIT, what=f"{workers} pods of JobSet {ns}/{name} Running on H100 nodes",
        on_timeout=lambda: what_holds_pods(cp, ns, name))
    return w, js, pods


def what_holds_pods(cp, ns, name):
    """What a test that timed out waiting for pods says: the JobSet's Jobs and pods, the
    namespace's latest events and the nodes' readiness and taints."""
    lines = []
    for j in cp.kubectl_json("get", "jobs", "-n", ns, "-l", f"{JOBSET_LABEL}={name}")["items"]:
        lines.append(f"job {j['metadata']['name']}: suspend={j['spec'].get('suspend')} "
                     f"status={j.get('status', {})}")
    for p in jobset_pods(cp, ns, name):
        st = p.get("status", {})
        lines.append(f"pod {p['metadata']['name']}: phase={st.get('phase')} node={p['spec'].get('nodeName')} "
                     f"gates={p['spec'].get('schedulingGates')} selector={p['spec'].get('nodeSelector')} "
                     f"conditions={[(c['type'], c['status'], c.get('message', '')) for c in st.get('conditions', [])]}")
    events = cp.kubectl_json("get", "events", "-n", ns)["items"]
    for e in events[-15:]:
        lines.append(f"event {e['involvedObject']['kind']}/{e['involvedObject']['name']}: {e['reason']}: {e['message']}")
    for n in cp.kubectl_json("get", "nodes")["items"]:
        ready = condition(n, "Ready")
        lines.append(f"node {n['metadata']['name']}: Ready={ready} taints={n['spec'].get('taints')}")
    for proc in cp._procs:
        if proc.exited() is not None:
            tail = proc.log.read_text(errors="replace").splitlines()[-5:]
            lines.append(f"process {proc.name} exited {proc.exited()}: " + " | ".join(tail))
    return "\n".join(lines)


def test_a_jobset_is_admitted_whole_and_runs_on_gpu_nodes(cp, queue):
    ns, lq = queue
    create(cp, ns, jobset("train", lq, workers=2, gpus=1))
    w, _, pods = wait_jobset_running(cp, ns, "train", 2)
    assert w["status"]["admission"]["clusterQueue"] == f"cq-{ns}"
    (podset,) = w["status"]["admission"]["podSetAssignments"]
    assert podset["count"] == 2
    assert podset["flavors"][GPU_RESOURCE] == FLAVOR
    assert podset["resourceUsage"][GPU_RESOURCE] == "2"
    assert {p["spec"]["nodeSelector"][GPU_PRODUCT_LABEL] for p in pods} == {"NVIDIA-H100"}
    # waitForPodsReady is on: Kueue follows the pods to PodsReady
    wait_until(lambda: condition(workload_of(cp, ns, "JobSet", "train"), "PodsReady") == "True",
               timeout=WAIT, what="the Workload's PodsReady condition")


def test_kueue_webhooks_are_on_loopback_and_leave_kinds_without_integration_alone(cp, queue):
    ns, _ = queue
    mutating = cp.kubectl_json("get", "mutatingwebhookconfiguration", "kueue-mutating-webhook-configuration")
    names = {w["name"] for w in mutating["webhooks"]}
    assert {"mjob.kb.io", "mjobset.kb.io", "mpod.kb.io", "mworkload.kb.io", "mclusterqueue.kb.io"} <= names
    assert all(w["clientConfig"]["url"].startswith("https://127.0.0.1:") for w in mutating["webhooks"])
    pod_hook = next(w for w in mutating["webhooks"] if w["name"] == "mpod.kb.io")
    assert "kube-system" in pod_hook["namespaceSelector"]["matchExpressions"][0]["values"]
    # Kueue answers the webhooks of the frameworks it does not integrate with no-ops, so a
    # Deployment (no integration here) is created as on any cluster
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "template": {
            "metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c", "image": IMAGE}]}}},
    }
    cp.kubectl("create", "--dry-run=server", "-n", ns, "-f", "-", input=yaml.safe_dump(deployment))


def test_a_jobset_over_the_remaining_quota_waits_suspended_without_pods(cp, queue):
    ns, lq = queue
    create(cp, ns, jobset("first", lq, workers=2, gpus=1))
    wait_jobset_running(cp, ns, "first", 2)
    create(cp, ns, jobset("second", lq, workers=2, gpus=2))  # 4 GPUs; 2 are left
    w = wait_until(
        lambda: (w := workload_of(cp, ns, "JobSet", "second")) and condition(w, "QuotaReserved") == "False" and w,
        timeout=WAIT, what="the second JobSet's Workload pending")
    assert "insufficient" in next(c for c in w["status"]["conditions"] if c["type"] == "QuotaReserved")["message"]
    assert condition(w, "Admitted") != "True"
    assert cp.kubectl_json("get", "jobset", "second", "-n", ns)["spec"]["suspend"] is True
    assert jobset_pods(cp, ns, "second") == []
    jobs = cp.kubectl_json("get", "jobs", "-n", ns, "-l", f"{JOBSET_LABEL}=second")["items"]
    assert all(j["spec"].get("suspend") for j in jobs)  # JobSet makes its Jobs suspended, or none yet

    cp.kubectl("delete", "jobset", "first", "-n", ns)
    wait_jobset_running(cp, ns, "second", 2)


def test_a_notebook_pod_waits_gated_until_quota_frees(cp, queue):
    ns, lq = queue
    create(cp, ns, jobset("train", lq, workers=2, gpus=1))
    wait_jobset_running(cp, ns, "train", 2)
    create(cp, ns, notebook_pod("jupyter-ann", lq, gpus=3))  # 3 GPUs; 2 are left
    w = wait_until(
        lambda: (w := workload_of(cp, ns, "Pod", "jupyter-ann")) and condition(w, "QuotaReserved") == "False" and w,
        timeout=WAIT, what="the notebook pod's Workload pending")
    assert condition(w, "Admitted") != "True"
    pod = cp.kubectl_json("get", "pod", "jupyter-ann", "-n", ns)
    assert {"name": ADMISSION_GATE} in pod["spec"].get("schedulingGates", [])
    assert not pod["spec"].get("nodeName")
    assert pod["status"].get("phase") == "Pending"

    cp.kubectl("delete", "jobset", "train", "-n", ns)
    wait_until(lambda: admitted(cp, ns, "Pod", "jupyter-ann"), timeout=WAIT, what="the notebook pod admitted")
    pod = wait_until(
        lambda: (p := cp.kubectl_json("get", "pod", "jupyter-ann", "-n", ns))["status"].get("phase") == "Running" and p,
        timeout=WAIT, what="the notebook pod Running")
    assert not pod["spec"].get("schedulingGates")
    assert pod["spec"]["nodeSelector"][GPU_PRODUCT_LABEL] == "NVIDIA-H100"
    assert pod["spec"]["nodeName"].startswith("gpu-h100-")


# --------------------------------------------------------------------------- pure builders


def test_kueue_configuration():
    assert kueue_configuration(webhook_port=9443, health_port=8081, cert_dir="/c") == {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": "127.0.0.1:8081"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": 9443, "host": "127.0.0.1", "certDir": "/c"},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "clientConnection": {"qps": 500, "burst": 1000},
        "controller": {"groupKindConcurrency": {
            "Job.batch": 5, "Pod": 20, "Workload.kueue.x-k8s.io": 20, "LocalQueue.kueue.x-k8s.io": 1,
            "Cohort.kueue.x-k8s.io": 1, "ClusterQueue.kueue.x-k8s.io": 1,
            "ResourceFlavor.kueue.x-k8s.io": 1}},
        "managedJobsNamespaceSelector": {"matchExpressions": [{
            "key": "kubernetes.io/metadata.name", "operator": "NotIn",
            "values": ["kube-system", "kueue-system", "jobset-system"]}]},
        "waitForPodsReady": {"timeout": "5m", "blockAdmission": False},
        "fairSharing": {"preemptionStrategies": ["LessThanOrEqualToFinalShare", "LessThanInitialShare"]},
        "integrations": {"frameworks": ["batch/job", "jobset.x-k8s.io/jobset", "pod"]},
        "visibilityServer": {"bindAddress": "127.0.0.1", "bindPort": 8082},
    }


def _hook(name, path):
    return {"name": name, "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": path}},
            "rules": [], "sideEffects": "None", "admissionReviewVersions": ["v1"]}


def test_kustomize_webhooks_applies_both_patch_styles_and_loopback_rewrites(tmp_path):
    docs = [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
         "metadata": {"name": "mutating-webhook-configuration"},
         "webhooks": [_hook("ma.kb.io", "/mutate-a"), _hook("mpod.kb.io", "/mutate--v1-pod")]},
    ]
    (tmp_path / "manifests.yaml").write_text(yaml.safe_dump_all(docs))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump([
        {"op": "replace", "path": "/webhooks/0", "value": {**_hook("ma.kb.io", "/mutate-a"), "objectSelector": {}}}]))
    inline = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
              "metadata": {"name": "mutating-webhook-configuration"},
              "webhooks": [{"name": "mpod.kb.io", "namespaceSelector": {"matchLabels": {"x": "y"}}}]}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["manifests.yaml"], "patches": [
        {"patch": yaml.safe_dump(inline)},
        {"path": "p.yaml", "target": {"kind": "MutatingWebhookConfiguration", "name": "mutating-webhook-configuration"}},
    ]}))
    (doc,) = kustomize_webhooks(tmp_path)
    assert doc["webhooks"][0]["objectSelector"] == {}
    assert doc["webhooks"][1]["namespaceSelector"] == {"matchLabels": {"x": "y"}}
    (out,) = loopback_webhooks([doc], prefix="kueue", port=9443, ca_pem=b"CA", keep_path=lambda p: p != "/mutate-a")
    assert out["metadata"] == {"name": "kueue-mutating-webhook-configuration"}
    assert [w["name"] for w in out["webhooks"]] == ["mpod.kb.io"]
    assert out["webhooks"][0]["clientConfig"] == {"url": "https://127.0.0.1:9443/mutate--v1-pod", "caBundle": "Q0E="}


def test_kustomize_crds_points_enabled_conversion_webhooks_at_loopback(tmp_path):
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "things.example.com"}, "spec": {"group": "example.com"}}
    other = {**crd, "metadata": {"name": "others.example.com"}, "spec": {"group": "example.com"}}
    (tmp_path / "bases").mkdir()
    (tmp_path / "bases" / "a.yaml").write_text(yaml.safe_dump(crd))
    (tmp_path / "bases" / "b.yaml").write_text(yaml.safe_dump(other))
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "webhook_in_things.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "things.example.com"},
        "spec": {"conversion": {"strategy": "Webhook", "webhook": {
            "clientConfig": {"service": {"namespace": "system", "name": "webhook-service", "path": "/convert"}},
            "conversionReviewVersions": ["v1"]}}}}))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["bases/a.yaml", "bases/b.yaml"],
        "patches": [{"path": "patches/webhook_in_things.yaml"}, {"path": "patches/cainjection_in_things.yaml"}]}))
    things, others = kustomize_crds(tmp_path, port=9443, ca_pem=b"CA")
    assert things["spec"]["conversion"] == {"strategy": "Webhook", "webhook": {
        "conversionReviewVersions": ["v1"],
        "clientConfig": {"url": "https://127.0.0.1:9443/convert", "caBundle": "Q0E="}}}
    assert "conversion" not in others["spec"]


def test_manager_rbac_binds_the_controllers_own_roles_to_its_service_account(tmp_path):
    (tmp_path / "role.yaml").write_text(yaml.safe_dump({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "manager-role"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]}))
    (tmp_path / "role_binding.yaml").write_text(yaml.safe_dump({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "manager-rolebinding"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "manager-role"},
        "subjects": [{"kind": "ServiceAccount", "name": "controller-manager", "namespace": "system"}]}))
    (tmp_path / "leader_election_role.yaml").write_text("kind: Role\n")  # not the manager's: left out
    objs = manager_rbac(tmp_path, name="kueue", namespace="kueue-system", service_account="kueue-controller-manager")
    assert [(o["kind"], o["metadata"]) for o in objs] == [
        ("Namespace", {"name": "kueue-system"}),
        ("ServiceAccount", {"name": "kueue-controller-manager", "namespace": "kueue-system"}),
        ("ClusterRole", {"name": "kueue-manager-role"}),
        ("ClusterRoleBinding", {"name": "kueue-manager-rolebinding"}),
    ]
    assert objs[3]["roleRef"]["name"] == "kueue-manager-role"
    assert objs[3]["subjects"] == [
        {"kind": "ServiceAccount", "name": "kueue-controller-manager", "namespace": "kueue-system"}]


# -- gpulab's own objects: its JobSets in the Kueue queues of its quota mirror (issue 18) ----

def gpulab_queues(cp, ns, user, max_gpus, pool):
    """``user``'s Kueue objects as `gpulab.hub.cluster.kueueobjects` builds them, for namespace
    ``ns`` (quota ``max_gpus``), in the root cohort holding a pool of ``pool`` GPUs, applied
    and Active."""
    from gpulab.hub.cluster.kueueobjects import (
        make_cluster_queues, make_cohorts, make_default_flavor, make_gpu_flavor,
        make_local_queues, make_priority_class, make_quota_flavor)

    queues = make_cluster_queues(namespace=ns, user_label=user, max_gpus=max_gpus)
    locals_ = make_local_queues(namespace=ns, user_label=user)
    cp.apply(make_gpu_flavor(None), make_quota_flavor(), make_default_flavor(), make_priority_class(),
             *make_cohorts(None, pool))
    cp.apply(*queues, *locals_)
    for q in queues:
        name = q["metadata"]["name"]
        wait_until(lambda: condition(cp.kubectl_json("get", "clusterqueue", name), "Active") == "True",
                   timeout=WAIT, what=f"ClusterQueue {name} Active")
    return [q["metadata"]["name"] for q in queues]


@pytest.fixture
def people(cp):
    """Two people, each a namespace with gpulab's queues (a quota of 2 GPUs each), in the
    root cohort holding a pool of 4 GPUs."""
    made = []
    for user in ("ann", "bob"):
        ns = f"gpulab-{user}-{uuid.uuid4().hex[:6]}"
        cp.create_namespace(ns)
        made.append((ns, gpulab_queues(cp, ns, user, 2, pool=4)))
    yield {"ann": made[0][0], "bob": made[1][0]}
    for ns, cqs in made:
        cp.kubectl("delete", "jobsets,pods", "--all", "-n", ns, "--wait=false", check=False)
        cp.api("DELETE", f"/api/v1/namespaces/{ns}")
        cp.kubectl("delete", "clusterqueue", *cqs, "--wait=false", check=False)


def gpulab_jobset(name, ns, *, workers, gpus, queue="gpulab", strategy="parameter-server"):
    from gpulab.hub.jobs.kubeobjects import Placement, make_training_jobset
    from gpulab.hub.jobs.spec import parse_spec
    from gpulab.hub.cluster.kueueobjects import PREEMPTIBLE_PRIORITY_CLASS, PREEMPTIBLE_QUEUE

    replicas = ({"chief": 1, "ps": 1, "worker": workers} if strategy == "parameter-server"
                else {"worker": workers})
    spec = parse_spec({"name": name, "strategy": strategy, "replicas": replicas,
                       "resources": {"worker": {"gpus": gpus}}, "script": "train.py"})
    return make_training_jobset(spec, Placement(namespace=ns, user_label="ann", image=IMAGE,
                                program="/gpulab/shared/users/ann/train.py",
                                job_dir="/gpulab/shared/users/ann/jobs/" + name,
                                user_dir="/gpulab/shared/users/ann", gpu_model="NVIDIA-H100"),
                                queue_name=queue, priority_class=PREEMPTIBLE_PRIORITY_CLASS
                                if queue == PREEMPTIBLE_QUEUE else None)


def test_gpulabs_jobset_is_admitted_whole_and_its_pods_have_the_host_names_of_tf_config(cp, people):
    """A parameter-server job (chief, ps, 2 workers of 1 GPU) as gpulab builds it passes
    JobSet's and Kueue's webhooks, is admitted whole in the person's in-quota ClusterQueue,
    and every replica's pod answers to the host name its TF_CONFIG gives it."""
    import json

    ns = people["ann"]
    create(cp, ns, gpulab_jobset("digits", ns, workers=2, gpus=1))
    w = wait_until(lambda: admitted(cp, ns, "JobSet", "digits"), timeout=WAIT,
                   what="gpulab's JobSet admitted")
    pods = wait_until(lambda: (p := jobset_pods(cp, ns, "digits")) and len(p) == 4 and all(
        x["status"].get("phase") == "Running" for x in p) and p, timeout=WAIT,
        what="its 4 pods Running")
    assert w["status"]["admission"]["clusterQueue"] == ns
    # the workers on H100 nodes (the flavor's node label), the chief and the ps on any node
    assert running_on_h100(cp, [p for p in pods if p["metadata"]["labels"]["gpulab.io/role"]
                                == "worker"])
    assert sorted(p["metadata"]["labels"]["gpulab.io/role"] for p in pods) == [
        "chief", "ps", "worker", "worker"]
    for p in pods:
        env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
        index = p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]
        cfg = json.loads(env["TF_CONFIG"].replace("$(GPULAB_TASK_INDEX)", index))
        me = f"{p['spec']['hostname']}.{p['spec']['subdomain']}.{ns}.svc:2222"
        assert cfg["cluster"][cfg["task"]["type"]][cfg["task"]["index"]] == me, (me, cfg)
    service = cp.kubectl_json("get", "service", "digits", "-n", ns)  # JobSet's headless one
    assert service["spec"]["clusterIP"] == "None"


def test_a_gpulab_job_over_the_persons_quota_waits_whole_without_a_pod(cp, people):
    ns = people["ann"]
    create(cp, ns, gpulab_jobset("first", ns, workers=2, gpus=1, strategy="multi-worker-mirrored"))
    wait_jobset_running(cp, ns, "first", 2)
    create(cp, ns, gpulab_jobset("second", ns, workers=1, gpus=1, strategy="multi-worker-mirrored"))
    wait_until(lambda: (w := workload_of(cp, ns, "JobSet", "second"))
               and condition(w, "QuotaReserved") == "False", timeout=WAIT,
               what="the second job pending")
    assert jobset_pods(cp, ns, "second") == []
    cp.kubectl("delete", "jobset", "first", "-n", ns)
    wait_jobset_running(cp, ns, "second", 1)


def test_only_the_persons_own_namespace_uses_their_cluster_queue(cp, people):
    """bob makes a LocalQueue in his namespace that names ann's ClusterQueue: his work there is
    never admitted (the ClusterQueue's namespaceSelector), so he cannot spend ann's quota."""
    ann, bob = people["ann"], people["bob"]
    cp.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
              "metadata": {"name": "anns", "namespace": bob}, "spec": {"clusterQueue": ann}})
    create(cp, bob, gpulab_jobset("steal", bob, workers=1, gpus=1, queue="anns",
                                  strategy="multi-worker-mirrored"))
    w = wait_until(lambda: (w := workload_of(cp, bob, "JobSet", "steal"))
                   and condition(w, "QuotaReserved") == "False" and w, timeout=WAIT,
                   what="bob's workload refused by ann's queue")
    reserved = next(c for c in w["status"]["conditions"] if c["type"] == "QuotaReserved")
    assert "namespace" in reserved["message"].lower(), reserved
    assert jobset_pods(cp, bob, "steal") == []


def test_preemptible_work_borrows_idle_quota_and_gives_it_back(cp, people):
    """ann's preemptible job borrows idle GPUs of the pool beyond her quota (her in-quota
    queue borrows only up to it); when bob's in-quota work needs them, Kueue preempts ann's
    job (its Workload evicted, its JobSet suspended) and admits bob's."""
    ann, bob = people["ann"], people["bob"]
    create(cp, ann, gpulab_jobset("big", ann, workers=1, gpus=4, queue="gpulab",
                                  strategy="multi-worker-mirrored"))
    w = wait_until(lambda: (w := workload_of(cp, ann, "JobSet", "big"))
                   and condition(w, "QuotaReserved") == "False" and w, timeout=WAIT,
                   what="4 GPUs of in-quota work refused by a quota of 2")
    cp.kubectl("delete", "jobset", "big", "-n", ann)
    create(cp, ann, gpulab_jobset("borrow", ann, workers=1, gpus=3, queue="gpulab-preemptible",
                                  strategy="multi-worker-mirrored"))
    w, _, _ = wait_jobset_running(cp, ann, "borrow", 1)
    assert w["status"]["admission"]["clusterQueue"] == f"{ann}.preemptible"
    create(cp, bob, gpulab_jobset("mine", bob, workers=2, gpus=1, strategy="multi-worker-mirrored"))
    wait_until(lambda: condition(workload_of(cp, ann, "JobSet", "borrow"), "Evicted") == "True",
               timeout=WAIT, what="ann's borrowing job preempted")
    wait_jobset_running(cp, bob, "mine", 2)
    assert cp.kubectl_json("get", "jobset", "borrow", "-n", ann)["spec"]["suspend"] is True


# -- gpulab's job backend with Kueue (c.KubeJobBackend.kueue), as the hub's RBAC allows ----

@pytest.fixture(scope="module")
def hub_kubeconfig(cp):
    from . import hubrbac

    return hubrbac.hub_kubeconfig(cp, "gpulab-hub-test")


@pytest.fixture
def kueue_backend_settings():
    """Settings of ``kueue_backend`` beside its own (a module may override this)."""
    return {}


@pytest.fixture
async def kueue_backend(cp, hub_kubeconfig, kueue_backend_settings, tmp_path, monkeypatch):
    """A KueueJobBackend as the hub's ServiceAccount (helm-values/rbac.yaml), with a real
    SQLite ledger."""
    from kubernetes_asyncio.config import kube_config
    from kubespawner.clients import load_config
    from traitlets.config import Config

    from gpulab.hub.jobs.kueue import backend_from_settings
    from gpulab.hub.quota.ledger import Ledger
    from gpulab.hub.cluster.namespaces import GPUQuotaMirror
    from gpulab.hub.cluster.kueuemirror import KueueMirror

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", hub_kubeconfig)
    load_config.cache_clear()
    ledger = Ledger(f"sqlite:///{tmp_path / 'gpulab.sqlite'}", pool="kubernetes")
    ledger.migrate()
    b = backend_from_settings(ledger, json.dumps({
        "kueue": True, "gpu_model": "NVIDIA-H100", "reconcile_interval": 0.2,
        "gpu_quota_sync_interval": 0.5, **kueue_backend_settings}))
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
    for mirror in list(KueueMirror._instances.values()):
        if mirror._task is not None:
            mirror._task.cancel()
    KueueMirror._instances.clear()


async def until(check, what, timeout=WAIT):
    """Poll the (sync) ``check`` in a thread every 0.2 s until it returns something truthy."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while True:
        got = await asyncio.to_thread(check)
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


def mw(name, workers, gpus=1, **kw):
    from gpulab.hub.jobs.spec import parse_spec

    return parse_spec({"name": name, "strategy": "multi-worker-mirrored",
                       "replicas": {"worker": workers}, "resources": {"worker": {"gpus": gpus}},
                       "script": "train.py", **kw})


async def test_kueue_admits_gpulab_jobs_whole_and_the_ledger_follows(cp, kueue_backend):
    """Through the job backend (the hub's credentials): the person's Kueue objects come from
    the ledger (the mirror); a job that fits is admitted by Kueue and runs, and only then
    does the ledger hold its GPUs; one that does not fit waits whole (Queued, Kueue's reason
    in words, no pod, no GPUs in the ledger) and starts by itself when the first is stopped;
    JobSet's completion ends it as Succeeded and closes its allocation. A job over the
    person's quota is refused at once; an admin's quota edit reaches the ClusterQueue."""
    from gpulab.hub.quota.ledger import AdmissionRefused
    from gpulab.hub.quota.policy import Quota

    b = kueue_backend
    user = f"k{uuid.uuid4().hex[:6]}"
    b.ledger.set_quota("user", user, Quota(max_gpus=2), actor="admin")
    ns = b.namespace_of(user)
    cqs = [ns, f"{ns}.preemptible"]
    try:
        with pytest.raises(AdmissionRefused) as e:
            await b.submit(user, (), mw("huge", 3))
        assert "your quota is 2" in str(e.value)

        first = await b.submit(user, (), mw("first", 2))
        assert first["state"] == "Queued" and b.ledger.open_allocations(user=user) == []
        cq = cp.kubectl_json("get", "clusterqueue", ns)
        assert cq["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "gpulab"
        assert gpu_quota(cq) == "2"
        # the pool: every GPU of the cluster's nodes (3 x 8 H100, 4 A10), of any model (by
        # default: test_queueing_models.py splits it), lent up to quotas
        assert pool_gpus(cp) == {"gpulab-gpu": "28"}
        assert "resourcequota" not in cp.kubectl("get", "resourcequota", "-n", ns, "-o", "name").stdout
        js = cp.kubectl_json("get", "jobset", "first", "-n", ns)
        assert js["metadata"]["labels"][QUEUE_NAME_LABEL] == "gpulab"
        owner = {o["kind"] for o in cp.kubectl_json("get", "networkpolicy", "first-replicas",
                                                      "-n", ns)["metadata"]["ownerReferences"]}
        assert owner == {"JobSet"}
        view = await until(lambda: (v := b.get(user, "first"))["state"] == "Running" and v,
                           "the first job Running")
        assert [a.gpus for a in b.ledger.open_allocations(user=user)] == [2]
        assert {r["state"] for r in view["replicas"]} == {"Running"}

        second = await b.submit(user, (), mw("second", 1))
        assert second["state"] == "Queued"
        view = await until(lambda: "insufficient" in (v := b.get(user, "second"))["reason"] and v,
                           "Kueue's reason for the second job")
        assert view["reason"].startswith("waiting for GPUs in the cluster's queue (next in line): ")
        assert jobset_pods(cp, ns, "second") == []
        assert [a.holder for a in b.ledger.open_allocations(user=user)] == ["first"]

        b.ledger.set_quota("user", user, Quota(max_gpus=3), actor="admin")  # reaches Kueue
        await until(lambda: gpu_quota(cp.kubectl_json("get", "clusterqueue", ns)) == "3",
                    "the ClusterQueue's quota of 3")
        await until(lambda: b.get(user, "second")["state"] == "Running", "the second job Running")
        b.ledger.set_quota("user", user, Quota(max_gpus=2), actor="admin")
        await b.stop(user, "second")
        await until(lambda: gpu_quota(cp.kubectl_json("get", "clusterqueue", ns)) == "2",
                    "the ClusterQueue's quota of 2 again")
        second = await b.submit(user, (), mw("second-again", 1))
        await until(lambda: "insufficient" in b.get(user, "second-again")["reason"],
                    "the third job waiting")
        stopped = await b.stop(user, "first")
        assert stopped["state"] == "Stopped"
        await until(lambda: b.get(user, "second-again")["state"] == "Running",
                    "the third job Running")
        assert [(a.holder, a.gpus) for a in b.ledger.open_allocations(user=user)] == [
            ("second-again", 1)]

        (pod,) = jobset_pods(cp, ns, "second-again")
        cp.api("PATCH", f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}",
               {"metadata": {"annotations": {"gpulab.test/exit": "0"}}},
               content_type="application/merge-patch+json", expect=(200,))
        done = await until(lambda: (v := b.get(user, "second-again"))["state"] == "Succeeded" and v,
                           "the third job Succeeded")
        assert done["reason"] == "completed"
        assert b.ledger.open_allocations(user=user) == []
        hours = b.ledger.usage(0)
        assert hours.get(user, 0) > 0  # both jobs' admitted time is in the GPU-hours
    finally:
        cp.kubectl("delete", "jobsets", "--all", "-n", ns, "--wait=false", check=False)
        cp.kubectl("delete", "clusterqueue", *cqs, "--wait=false", check=False)


def gpu_quota(cq):
    """A person's GPU quota in their in-quota ClusterQueue: what it may borrow of the pool's
    GPUs of any model (the quota's resource where the pool is split by model)."""
    groups = {tuple(g["coveredResources"]): g for g in cq["spec"]["resourceGroups"]}
    resource = QUOTA_RESOURCE if (QUOTA_RESOURCE,) in groups else GPU_RESOURCE
    (flavor,) = groups[(resource,)]["flavors"]
    return next(r.get("borrowingLimit") for r in flavor["resources"] if r["name"] == resource)


def pool_gpus(cp):
    """The GPUs of the pool (the root cohort gpulab): ``{flavor: count}`` per model, and
    their sum under ``"total"``."""
    groups = cp.kubectl_json("get", "cohort", "gpulab")["spec"]["resourceGroups"]
    out = {}
    for g in groups:
        for f in g["flavors"]:
            for r in f["resources"]:
                if r["name"] == GPU_RESOURCE:
                    out[f["name"]] = r["nominalQuota"]
                elif r["name"] == QUOTA_RESOURCE:
                    out["total"] = r["nominalQuota"]
    return out


async def test_a_used_up_budget_holds_admissions_and_a_restarted_service_loses_nothing(
        cp, kueue_backend, hub_kubeconfig):
    """A GPU-hour budget used up holds the person's ClusterQueue: a new job waits, with the
    reason in words, and no pod. The service restarts meanwhile (a new backend and mirror on
    the same ledger, as a new process, which had stopped before making the job's
    NetworkPolicy: the new one makes it): when the admin raises the budget, the hold lifts and
    the job that waited runs; its stop closes its allocation. The hub's credentials cannot
    change a Kueue object gpulab did not make."""
    import time

    from gpulab.hub.jobs.kueue import backend_from_settings
    from gpulab.hub.quota.ledger import Request
    from gpulab.hub.quota.policy import Quota
    from gpulab.hub.cluster.kueuemirror import KueueMirror

    b = kueue_backend
    user = f"h{uuid.uuid4().hex[:6]}"
    ns = b.namespace_of(user)
    # half an hour of one GPU, in the last day: the whole budget
    past = b.ledger.adopt(Request(user=user, kind="job", holder="earlier", gpus=1),
                          now=time.time() - 1800)
    b.ledger.release(past.id, "job succeeded")
    b.ledger.set_quota("user", user, Quota(max_gpus=2, gpu_hours=0.5, window_hours=24),
                       actor="admin")
    try:
        await b.submit(user, ("team",), mw("held", 1))
        assert cp.kubectl_json("get", "clusterqueue", ns)["spec"]["stopPolicy"] == "Hold"
        view = await until(lambda: (v := b.get(user, "held"))["reason"].startswith(
            "waiting: your GPU-hour budget is used up") and v, "the held job's reason")
        assert view["state"] == "Queued" and jobset_pods(cp, ns, "held") == []
        js = cp.kubectl_json("get", "jobset", "held", "-n", ns)
        assert json.loads(js["metadata"]["annotations"]["gpulab.io/groups"]) == ["team"]

        # the service restarts: nothing of the old process is left but the ledger, and it
        # stopped between the JobSet and its NetworkPolicy (deleted here)
        cp.kubectl("delete", "networkpolicy", "held-replicas", "-n", ns)
        await b.shutdown()
        for mirror in list(KueueMirror._instances.values()):
            if mirror._task is not None:
                mirror._task.cancel()
        KueueMirror._instances.clear()
        b2 = backend_from_settings(b.ledger, json.dumps({
            "kueue": True, "gpu_model": "NVIDIA-H100", "reconcile_interval": 0.2,
            "gpu_quota_sync_interval": 0.5}))
        await asyncio_to_thread(b2.recover)
        b2.ensure_supervisor()
        def policy_of_held():
            r = cp.kubectl("get", "networkpolicy", "held-replicas", "-n", ns, "-o", "json",
                           check=False)
            return json.loads(r.stdout) if r.returncode == 0 else None

        policy = await until(policy_of_held, "the job's NetworkPolicy made again")
        assert [o["kind"] for o in policy["metadata"]["ownerReferences"]] == ["JobSet"]
        b.ledger.set_quota("user", user, Quota(max_gpus=2, gpu_hours=100, window_hours=24),
                           actor="admin")
        await until(lambda: "stopPolicy" not in cp.kubectl_json("get", "clusterqueue", ns)["spec"]
                    or cp.kubectl_json("get", "clusterqueue", ns)["spec"]["stopPolicy"] == "None",
                    "the hold lifted")
        await until(lambda: b2.get(user, "held")["state"] == "Running", "the held job Running")
        assert [a.holder for a in b2.ledger.open_allocations(user=user)] == ["held"]
        await b2.stop(user, "held")
        assert b2.ledger.open_allocations(user=user) == []
        await b2.shutdown()
    finally:
        cp.kubectl("delete", "jobsets", "--all", "-n", ns, "--wait=false", check=False)
        cp.kubectl("delete", "clusterqueue", ns, f"{ns}.preemptible", "--wait=false", check=False)

    # the hub may apply its own Kueue objects, never take over another's
    foreign = f"other-team-{uuid.uuid4().hex[:6]}"
    cp.apply({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
              "metadata": {"name": foreign}, "spec": {"namespaceSelector": {}}})
    try:
        r = cp.kubectl("label", "clusterqueue", foreign, "app.kubernetes.io/managed-by=gpulab",
                       kubeconfig=hub_kubeconfig, check=False)
        assert r.returncode != 0 and "gpulab-hub-owned-namespaces" in r.stderr, r.stderr
        r = cp.kubectl("delete", "clusterqueue", foreign, kubeconfig=hub_kubeconfig, check=False)
        assert r.returncode != 0 and "gpulab-hub-owned-namespaces" in r.stderr, r.stderr
        # nor make objects labelled as its own that say something its mirror never says
        gpulab = {"app.kubernetes.io/managed-by": "gpulab"}
        forged = [
            # a cohort of another team's, pulled under gpulab's tree
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Cohort",
             "metadata": {"name": f"team-{foreign}", "labels": gpulab},
             "spec": {"parentName": "gpulab"}},
            # a ClusterQueue admitting every namespace
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
             "metadata": {"name": f"gpulab-{foreign}", "labels": gpulab},
             "spec": {"cohortName": "gpulab", "namespaceSelector": {}}},
            # a priority above everyone's, to preempt other people's work with
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
             "metadata": {"name": f"gpulab-{foreign}", "labels": gpulab}, "value": 1000},
            # a ClusterQueue owning quota of its own (beyond the pool, reclaimable from others)
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
             "metadata": {"name": f"gpulab-{foreign}", "labels": gpulab},
             "spec": {"cohortName": "gpulab", "namespaceSelector": {"matchLabels": {
                 "kubernetes.io/metadata.name": f"gpulab-{foreign}"}},
                 "resourceGroups": [{"coveredResources": [GPU_RESOURCE], "flavors": [{
                     "name": "gpulab-gpu", "resources": [
                         {"name": GPU_RESOURCE, "nominalQuota": "100"}]}]}],
                 "preemption": {"reclaimWithinCohort": "Any",
                                "withinClusterQueue": "LowerPriority"}}},
            # a job of a gpulab namespace with a priority above everyone's in Kueue
            {**gpulab_jobset("vip", ns, workers=1, gpus=1, strategy="multi-worker-mirrored"),
             "metadata": {"name": "vip", "namespace": ns, "labels": {
                 **gpulab, "kueue.x-k8s.io/queue-name": "gpulab",
                 "kueue.x-k8s.io/priority-class": "system-cluster-critical"}}},
            # a LocalQueue of a gpulab namespace sending work to another team's queue
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
             "metadata": {"name": "steal", "namespace": ns, "labels": gpulab},
             "spec": {"clusterQueue": foreign}},
        ]
        # a JobSet whose pods carry a PriorityClass, or a Kueue priority, of their own
        for where, value in (("priorityClassName", "system-node-critical"),
                             ("label", "system-cluster-critical")):
            js = gpulab_jobset("vip-pods", ns, workers=1, gpus=1, strategy="multi-worker-mirrored")
            pod_template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
            if where == "label":
                pod_template.setdefault("metadata", {}).setdefault("labels", {})[
                    "kueue.x-k8s.io/priority-class"] = value
            else:
                pod_template["spec"]["priorityClassName"] = value
            forged.append(js)
        for obj in forged:
            r = cp.kubectl("create", "-f", "-", input=yaml.safe_dump(obj),
                           kubeconfig=hub_kubeconfig, check=False)
            assert r.returncode != 0 and "gpulab-hub-owned-namespaces" in r.stderr, (obj, r.stderr)
            if obj["kind"] == "JobSet":
                assert "no priority but gpulab-preemptible" in r.stderr, r.stderr
    finally:
        cp.kubectl("delete", "clusterqueue", foreign, "--wait=false", check=False)


async def test_a_person_who_left_loses_their_queues_and_a_returning_one_gets_new_ones(
        cp, kueue_backend, hub_kubeconfig, tmp_path):
    """A person's account is deleted: the hub (KubeGPUSpawner.delete_forever of the default
    server, as JupyterHub calls it, with the hub's credentials, in a process of its own: a
    thread with its own event loop here) deletes their ClusterQueues and LocalQueues. Kueue
    lets their running job finish and never admits the one that waits. The service's mirror
    forgets them: an admin's quota edit does not make the queues again. When the person comes
    back, their first job gets new queues, with their quota of now, and runs."""
    import asyncio
    from types import SimpleNamespace

    from jupyterhub.objects import Hub
    from traitlets.config import Config

    from gpulab.hub.quota.policy import Quota
    from gpulab.spawner.kube import KubeGPUSpawner
    from gpulab.hub.quota.settings import GPULedger

    b = kueue_backend
    user = f"d{uuid.uuid4().hex[:6]}"
    ns = b.namespace_of(user)
    queues = [("clusterqueue", ns, None), ("clusterqueue", f"{ns}.preemptible", None),
              ("localqueue", "gpulab", ns), ("localqueue", "gpulab-preemptible", ns)]

    def present():
        out = []
        for kind, name, where in queues:
            r = cp.kubectl("get", kind, name, *(["-n", where] if where else []), "-o", "json",
                           check=False)
            if r.returncode == 0 and not json.loads(r.stdout)["metadata"].get("deletionTimestamp"):
                out.append(name if kind == "clusterqueue" else f"{where}/{name}")
        return out

    b.ledger.set_quota("user", user, Quota(max_gpus=1), actor="admin")
    try:
        await b.submit(user, (), mw("runs", 1))
        await until(lambda: b.get(user, "runs")["state"] == "Running", "the first job Running")
        await b.submit(user, (), mw("waits", 1))
        await until(lambda: b.get(user, "waits")["reason"].startswith("waiting"), "the second waiting")
        assert len(present()) == 4

        def hub_deletes_the_account():
            async def go():
                c = Config()
                c.GPULedger.db_url = b.ledger.url
                c.GPULedger.pool = "kubernetes"
                c.KubeGPUSpawner.kueue = True
                s = KubeGPUSpawner(config=c, user=SimpleNamespace(
                    name=user, id=2, url=f"/user/{user}/", groups=[]), hub=Hub(),
                    api_token="not-a-token", oauth_client_id=f"jupyterhub-user-{user}")
                assert s.namespace == ns
                await s.delete_forever()
            GPULedger.clear_instance()
            try:
                asyncio.run(go())
            finally:
                GPULedger.clear_instance()

        await asyncio.to_thread(hub_deletes_the_account)
        assert present() == []
        # the running job goes on (Kueue keeps its ClusterQueue until it ends), the waiting one
        # is never admitted
        mirror = b.mirror()
        b.ledger.set_quota("user", user, Quota(max_gpus=2), actor="admin")  # room for both
        await until(lambda: ns not in mirror.users, "the service's mirror forgetting the person")
        await asyncio.sleep(3)  # six passes of the mirror (0.5 s), and of the backend
        assert present() == []
        assert b.get(user, "runs")["state"] == "Running"
        assert b.get(user, "waits")["state"] == "Queued" and jobset_pods(cp, ns, "waits") == []
        await b.stop(user, "runs")
        await b.stop(user, "waits")
        await until(lambda: cp.kubectl("get", "clusterqueue", ns, check=False).returncode != 0,
                    "the ClusterQueue gone once its work ended")

        # the person comes back: new queues with their first job, which runs
        await b.submit(user, (), mw("again", 2))
        assert len(present()) == 4
        cq = cp.kubectl_json("get", "clusterqueue", ns)
        assert gpu_quota(cq) == "2"
        await until(lambda: b.get(user, "again")["state"] == "Running", "the returning job Running")
        await b.stop(user, "again")
    finally:
        cp.kubectl("delete", "jobsets", "--all", "-n", ns, "--wait=false", check=False)
        cp.kubectl("delete", "clusterqueue", ns, f"{ns}.preemptible", "--wait=false", check=False)


async def asyncio_to_thread(fn, *args):
    import asyncio

    return await asyncio.to_thread(fn, *args)


async def test_a_preemptible_job_borrows_is_preempted_and_waits_again(cp, kueue_backend):
    """ann's preemptible job borrows the idle pool beyond her quota (admitted in her
    preemptible queue, the ledger holding its GPUs meanwhile); bob's in-quota job needs them:
    Kueue preempts hers (lower priority), which is Queued again with the reason and its
    allocation closed, and runs again by itself when bob's job ends. Their quotas are their
    groups' (each in-quota queue in its group's cohort), and bob's teammate carl already
    uses 2 GPUs: bob's group then uses as much as ann's preemptible job, which is taken back
    all the same (fair sharing alone would keep it if her preemptible queue were in her
    group's cohort)."""
    b = kueue_backend
    b.kueue_gpus = 6  # a pool of 6 GPUs (c.KubeJobBackend.kueue_gpus): carl's 2, ann's 4
    tag = uuid.uuid4().hex[:6]
    ann, bob, carl = f"pa{tag}", f"pb{tag}", f"pc{tag}"
    from gpulab.hub.quota.policy import Quota
    from gpulab.hub.cluster.kueueobjects import cohort_name

    groups = {ann: (f"ga{tag}",), bob: (f"gb{tag}",), carl: (f"gb{tag}",)}
    for g in (f"ga{tag}", f"gb{tag}"):
        b.ledger.set_quota("group", g, Quota(max_gpus=2), actor="admin")
    ours = {b.namespace_of(x) for x in (ann, bob, carl)}
    ours |= {f"{n}.preemptible" for n in ours}

    def others_in_the_cohort():
        return [q["metadata"]["name"] for q in cp.kubectl_json("get", "clusterqueues")["items"]
                if q["spec"].get("cohortName", "").startswith("gpulab")
                and q["metadata"]["name"] not in ours]

    # the cohort's spare GPUs are bob's alone (other tests' queues are gone)
    await until(lambda: not others_in_the_cohort(), "the other tests' ClusterQueues gone")
    try:
        await b.submit(bob, groups[bob], mw("idle-check", 1, gpus=0))  # bob's queues, unused
        await b.submit(carl, groups[carl], mw("team", 2))
        await until(lambda: b.get(carl, "team")["state"] == "Running", "carl's job Running")
        borrow = await b.submit(ann, groups[ann], mw("borrow", 4, preemptible=True))
        assert borrow["state"] == "Queued"
        await until(lambda: b.get(ann, "borrow")["state"] == "Running", "ann's borrowing job Running")
        w = workload_of(cp, b.namespace_of(ann), "JobSet", "borrow")
        assert w["status"]["admission"]["clusterQueue"] == f"{b.namespace_of(ann)}.preemptible"
        assert [a.gpus for a in b.ledger.open_allocations(user=ann)] == [4]
        cohorts = {q["metadata"]["name"]: q["spec"]["cohortName"]
                   for q in cp.kubectl_json("get", "clusterqueues")["items"]}
        assert cohorts[b.namespace_of(bob)] == cohort_name(groups[bob][0])
        assert cohorts[f"{b.namespace_of(ann)}.preemptible"] == "gpulab"

        await b.submit(bob, groups[bob], mw("mine", 2))
        view = await until(lambda: (v := b.get(ann, "borrow"))["state"] == "Queued" and v,
                           "ann's job preempted")
        assert view["reason"].startswith("waiting for GPUs again: Preempted"), view["reason"]
        assert b.ledger.open_allocations(user=ann) == []
        await until(lambda: b.get(bob, "mine")["state"] == "Running", "bob's job Running")
        await b.stop(bob, "mine")
        await until(lambda: b.get(ann, "borrow")["state"] == "Running", "ann's job running again")
        assert b.get(carl, "team")["state"] == "Running"  # in-quota work is never preempted
    finally:
        for who in (ann, bob, carl):
            ns = b.namespace_of(who)
            cp.kubectl("delete", "jobsets", "--all", "-n", ns, "--wait=false", check=False)
            cp.kubectl("delete", "clusterqueue", ns, f"{ns}.preemptible", "--wait=false",
                       check=False)
        cp.kubectl("delete", "cohort", cohort_name(f"ga{tag}"), cohort_name(f"gb{tag}"),
                   "--wait=false", check=False)


async def test_a_gpu_notebook_waits_in_the_persons_queue_and_the_progress_says_why(
        cp, hub_kubeconfig, tmp_path, monkeypatch):
    """With Kueue, a GPU server's pod (KubeGPUSpawner, the hub's credentials) waits gated in
    the same queue as its person's jobs: while their job holds the quota the pod has no node,
    the ledger holds nothing for it and the progress stream says why in words; when the job
    stops Kueue admits the pod, the server starts on an H100 node and the ledger records its
    GPU; stopping the server closes it. A server asking more than the quota is refused at
    once."""
    import asyncio
    from types import SimpleNamespace

    from jupyterhub.objects import Hub
    from kubernetes_asyncio.config import kube_config
    from kubespawner.clients import load_config
    from traitlets.config import Config

    from gpulab.hub.jobs.kueue import backend_from_settings
    from gpulab.hub.quota.ledger import Ledger
    from gpulab.hub.quota.policy import Quota
    from gpulab.hub.cluster.kueuewatch import REFLECTOR_KEY, WorkloadWatch
    from gpulab.hub.cluster.namespaces import GPUQuotaMirror
    from gpulab.spawner.kube import KubeGPUSpawner
    from gpulab.hub.cluster.kueuemirror import KueueMirror
    from gpulab.hub.quota.settings import GPULedger
    from gpulab.spawner.mixin import SpawnRefused

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", hub_kubeconfig)
    load_config.cache_clear()
    url = f"sqlite:///{tmp_path / 'gpulab.sqlite'}"
    ledger = Ledger(url, pool="kubernetes")
    ledger.migrate()
    user = f"n{uuid.uuid4().hex[:6]}"
    ledger.set_quota("user", user, Quota(max_gpus=2), actor="admin")
    backend = backend_from_settings(ledger, json.dumps({
        "kueue": True, "gpu_model": "NVIDIA-H100", "reconcile_interval": 0.2}))
    backend.ensure_supervisor()
    await backend.start_watches()

    def h100(n):
        return {"display_name": f"{n} H100", "slug": f"h100-{n}", "kubespawner_override": {
            "extra_resource_limits": {"nvidia.com/gpu": str(n)},
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
            "cpu_limit": 1, "mem_limit": "1G"}}

    c = Config()
    c.GPULedger.db_url = url
    c.GPULedger.pool = "kubernetes"
    c.KubeGPUSpawner.kueue = True
    c.KubeGPUSpawner.profile_list = [h100(1), h100(3)]
    c.KubeGPUSpawner.storage_pvc_ensure = False
    c.KubeGPUSpawner.start_timeout = 120
    c.KubeGPUSpawner.gpu_quota_sync_interval = 0.5
    GPULedger.clear_instance()
    s = KubeGPUSpawner(config=c, user=SimpleNamespace(name=user, id=1, url=f"/user/{user}/",
                                                      groups=[]),
                       hub=Hub(), api_token="not-a-token", oauth_client_id=f"jupyterhub-user-{user}")
    ns = s.namespace
    try:
        s.user_options = {"profile": "h100-3"}
        with pytest.raises(SpawnRefused) as e:
            await s.start()
        assert e.value.status_code == 409 and "your quota is 2 GPUs at once" in e.value.jupyterhub_message

        await backend.submit(user, (), mw("train", 2))
        await until(lambda: backend.get(user, "train")["state"] == "Running", "the job Running")

        s.user_options = {"profile": "h100-1"}
        started = asyncio.ensure_future(s.start())
        events = s.progress()
        said = []
        while not any(m.startswith("Waiting for GPUs in your queue (next in line):")
                      for m in said):
            event = await asyncio.wait_for(events.__anext__(), 60)
            said.append(event.get("message", ""))
        words = next(m for m in said if m.startswith("Waiting for GPUs in your queue"))
        assert "insufficient" in words, said
        # read from the hub's one Workload watch (issue 40: not a list per waiting server),
        # which runs while this stream needs it
        assert KubeGPUSpawner.reflectors.get(REFLECTOR_KEY) is not None
        assert WorkloadWatch.shared().users == 1
        # the place is Kueue's own, from its visibility API (with the hub's credentials)
        assert not s._said_no_visibility
        status, pending = cp.api("GET", f"/apis/visibility.kueue.x-k8s.io/v1beta2/namespaces/{ns}"
                                 "/localqueues/gpulab/pendingworkloads", expect=(200,))
        assert [(w["positionInLocalQueue"], w["metadata"]["ownerReferences"][0]["name"])
                for w in pending["items"]] == [(0, s.pod_name)], pending
        pod = cp.kubectl_json("get", "pod", s.pod_name, "-n", ns)
        assert pod["metadata"]["labels"][QUEUE_NAME_LABEL] == "gpulab"
        assert {"name": ADMISSION_GATE} in pod["spec"]["schedulingGates"]
        assert not pod["spec"].get("nodeName") and not started.done()
        assert [a.kind for a in ledger.open_allocations(user=user)] == ["job"]

        await backend.stop(user, "train")
        await asyncio.wait_for(started, 60)
        pod = cp.kubectl_json("get", "pod", s.pod_name, "-n", ns)
        assert pod["spec"]["nodeName"].startswith("gpu-h100-")
        assert [(a.kind, a.holder, a.gpus) for a in ledger.open_allocations(user=user)] == [
            ("notebook", "default", 1)]
        await events.aclose()
        assert WorkloadWatch.shared().users == 0  # stops IDLE_SECONDS after the last stream
        await s.stop()
        assert ledger.open_allocations(user=user) == []
    finally:
        try:
            await s.stop(now=True)
        except Exception:  # noqa: BLE001 - best effort
            pass
        await backend.shutdown()
        await KubeGPUSpawner._stop_all_reflectors()
        for mirrors in (GPUQuotaMirror._instances, KueueMirror._instances):
            for mirror in list(mirrors.values()):
                if mirror._task is not None:
                    mirror._task.cancel()
            mirrors.clear()
        GPULedger.clear_instance()
        cp.kubectl("delete", "jobsets,pods", "--all", "-n", ns, "--wait=false", check=False)
        cp.kubectl("delete", "clusterqueue", ns, f"{ns}.preemptible", "--wait=false", check=False)


async def test_idle_gpus_are_shared_fairly_between_two_people(cp, kueue_backend):
    """Fair sharing: carol's job fills the pool of 4 GPUs; ann and bob (no quota of their
    own) each queue four preemptible 1-GPU jobs, ann's first. When carol's job ends and the
    4 GPUs are free, Kueue gives them two and two (first come, first served would give ann
    all four)."""
    from gpulab.hub.quota.policy import Quota

    b = kueue_backend
    b.kueue_gpus = 4  # a pool of 4 GPUs, which carol's job fills
    tag = uuid.uuid4().hex[:6]
    carol, ann, bob = f"fc{tag}", f"fa{tag}", f"fb{tag}"
    b.ledger.set_quota("user", carol, Quota(max_gpus=4), actor="admin")
    for who in (ann, bob):
        b.ledger.set_quota("user", who, Quota(max_gpus=0), actor="admin")
    ours = {b.namespace_of(x) for x in (carol, ann, bob)}
    ours |= {f"{n}.preemptible" for n in ours}

    def others_in_the_cohort():
        return [q["metadata"]["name"] for q in cp.kubectl_json("get", "clusterqueues")["items"]
                if q["spec"].get("cohortName") == "gpulab" and q["metadata"]["name"] not in ours]

    await until(lambda: not others_in_the_cohort(), "the other tests' ClusterQueues gone")
    try:
        await b.submit(carol, (), mw("lender", 4))
        await until(lambda: b.get(carol, "lender")["state"] == "Running", "carol's job Running")
        for who in (ann, bob):
            for i in range(4):
                await b.submit(who, (), mw(f"j{i}", 1, preemptible=True))
        await asyncio_sleep(2)
        assert {j["state"] for who in (ann, bob) for j in b.list(who)} == {"Queued"}
        await b.stop(carol, "lender")

        def running(who):
            return sum(j["state"] == "Running" for j in b.list(who))

        await until(lambda: running(ann) + running(bob) == 4, "4 borrowing jobs Running")
        await asyncio_sleep(2)  # nothing more is admitted: the 4 GPUs are lent out
        assert (running(ann), running(bob)) == (2, 2)
        assert sum(a.gpus for who in (ann, bob) for a in b.ledger.open_allocations(user=who)) == 4
    finally:
        for who in (carol, ann, bob):
            ns = b.namespace_of(who)
            cp.kubectl("delete", "jobsets", "--all", "-n", ns, "--wait=false", check=False)
            cp.kubectl("delete", "clusterqueue", ns, f"{ns}.preemptible", "--wait=false",
                       check=False)


async def asyncio_sleep(seconds):
    import asyncio

    await asyncio.sleep(seconds)


async def test_a_held_cluster_is_admitted_whole_and_stop_frees_its_gpus(cp, kueue_backend):
    """A cluster (issue 38: ``kind: cluster``, 1 ps and 2 one-GPU workers, no chief, no
    code) through the job backend: Kueue admits its JobSet whole, its view gives the kernel
    the addresses of its servers (the host names its pods answer to), its NetworkPolicies go
    with it; a second cluster over the quota waits whole without a pod; a worker pod that is
    lost comes back under the same host name while the cluster goes on; stopping the first
    frees its GPUs for the second; a ps that fails ends the second in words."""
    from gpulab.hub.jobs.spec import parse_spec
    from gpulab.hub.quota.policy import Quota

    b = kueue_backend
    user = f"c{uuid.uuid4().hex[:6]}"
    b.ledger.set_quota("user", user, Quota(max_gpus=3), actor="admin")
    ns = b.namespace_of(user)

    def held(name):
        return parse_spec({"name": name, "kind": "cluster", "strategy": "parameter-server",
                           "replicas": {"ps": 1, "worker": 2}, "resources": {"worker": {"gpus": 1}}})
    try:
        first = await b.submit(user, (), held("held"))
        assert first["state"] == "Queued" and first["kind"] == "cluster"
        view = await until(lambda: (v := b.get(user, "held"))["state"] == "Running" and v,
                           "the cluster Running")
        assert [(a.holder, a.gpus) for a in b.ledger.open_allocations(user=user)] == [("held", 2)]
        assert view["cluster"] == {
            "ps": [f"held-ps-0-0.held.{ns}.svc:2222"],
            "worker": [f"held-worker-0-{i}.held.{ns}.svc:2222" for i in range(2)]}
        pods = jobset_pods(cp, ns, "held")
        answers = {f"{p['spec']['hostname']}.{p['spec']['subdomain']}.{ns}.svc:2222" for p in pods}
        assert answers == {*view["cluster"]["ps"], *view["cluster"]["worker"]}
        for p in pods:
            env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
            assert env["GPULAB_KIND"] == "cluster" and "chief" not in env["TF_CONFIG"]
        policies = {p["metadata"]["name"]: {o["kind"] for o in p["metadata"]["ownerReferences"]}
                    for p in cp.kubectl_json("get", "networkpolicy", "-n", ns, "-l",
                                             "gpulab.io/job=held")["items"]}
        assert policies == {"held-replicas": {"JobSet"}, "held-coordinator": {"JobSet"}}

        second = await b.submit(user, (), held("next"))
        await until(lambda: "insufficient" in b.get(user, "next")["reason"], "the second waiting")
        assert jobset_pods(cp, ns, "next") == []

        # a worker that crashes (kwok's pods never end by deletion: no kubelet makes them
        # Failed) is replaced under the same host name, and the cluster is held again
        lost = next(p for p in pods if p["metadata"]["labels"]["gpulab.io/role"] == "worker")
        cp.api("PATCH", f"/api/v1/namespaces/{ns}/pods/{lost['metadata']['name']}",
               {"metadata": {"annotations": {"gpulab.test/exit": "1"}}},
               content_type="application/merge-patch+json", expect=(200,))
        try:
            back = await until(lambda: [p for p in jobset_pods(cp, ns, "held")
                                        if p["spec"]["hostname"] == lost["spec"]["hostname"]
                                        and p["metadata"]["name"] != lost["metadata"]["name"]
                                        and p["status"].get("phase") == "Running"],
                               "the lost worker back")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{what_holds_pods(cp, ns, 'held')}") from None
        assert len(back) == 1
        view = await until(lambda: (v := b.get(user, "held"))["state"] == "Running" and v,
                           "the cluster Running again")
        index = int(lost["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"])
        assert view["replicas"][1 + index]["restarts"] >= 1, view["replicas"]

        stopped = await b.stop(user, "held")
        assert stopped["state"] == "Stopped"
        assert [a.holder for a in b.ledger.open_allocations(user=user)] == []
        await until(lambda: b.get(user, "next")["state"] == "Running", "the second Running")
        assert [(a.holder, a.gpus) for a in b.ledger.open_allocations(user=user)] == [("next", 2)]

        # its ps fails: no second ps is made (it would hold none of the variables)
        (ps,) = [p for p in jobset_pods(cp, ns, "next") if p["metadata"]["labels"]["gpulab.io/role"] == "ps"]
        cp.api("PATCH", f"/api/v1/namespaces/{ns}/pods/{ps['metadata']['name']}",
               {"metadata": {"annotations": {"gpulab.test/exit": "1"}}},
               content_type="application/merge-patch+json", expect=(200,))
        ended = await until(lambda: (v := b.get(user, "next"))["state"] == "Failed" and v,
                            "the second cluster Failed")
        assert ended["reason"].startswith("parameter server ps-0 was lost"), ended["reason"]
        assert "last checkpoint" in ended["reason"]
        assert b.ledger.open_allocations(user=user) == []
    finally:
        cp.kubectl("delete", "jobsets", "--all", "-n", ns, "--wait=false", check=False)
        cp.kubectl("delete", "clusterqueue", ns, f"{ns}.preemptible", "--wait=false", check=False)


async def test_a_gpu_notebooks_spawn_makes_a_bounded_number_of_api_requests(
        cp, hub_kubeconfig, tmp_path, monkeypatch):
    """Issue 40's bound, on one spawn of the hub (the hub's credentials, Kueue on): a
    person's first spawn makes their namespace, its two NetworkPolicies and default
    ServiceAccount, applies their in-quota ClusterQueue and LocalQueue (the only queue a
    notebook waits in; the preemptible pair comes with their first job) and creates the pod:
    7 requests, none of them a read, stock + 5 (no ResourceQuota DELETE in a namespace the
    spawn has just made: 10 before, bench/scale_kube.py; no LimitRange: the pod carries the
    container defaults); a returning person's spawn only what stock KubeSpawner makes (the
    namespace, the pod) and the namespace's policies again (stock + 2). Would fail if a redundant request per
    spawn came back (a read, a per-spawn DELETE, a list of everyone's quotas through the API).
    The shared watches and Kueue's shared objects are started first and not counted, as
    bench/scale_kube.py does."""
    import asyncio
    import collections
    from types import SimpleNamespace

    from jupyterhub.objects import Hub
    from kubernetes_asyncio.client import rest
    from kubernetes_asyncio.config import kube_config
    from kubespawner import KubeSpawner
    from kubespawner.clients import load_config
    from traitlets.config import Config

    from gpulab.hub.cluster.kueuemirror import KueueMirror
    from gpulab.hub.cluster.namespaces import GPUQuotaMirror
    from gpulab.hub.quota.ledger import Ledger
    from gpulab.hub.quota.policy import Quota
    from gpulab.hub.quota.settings import GPULedger
    from gpulab.spawner.kube import KubeGPUSpawner
    from gpulab.spawner.mixin import hub_ledger

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", hub_kubeconfig)
    load_config.cache_clear()
    url = f"sqlite:///{tmp_path / 'gpulab.sqlite'}"
    ledger = Ledger(url, pool="kubernetes")
    ledger.migrate()
    user = f"r{uuid.uuid4().hex[:6]}"
    ledger.set_quota("user", user, Quota(max_gpus=2, gpu_hours=100, window_hours=168),
                     actor="admin")
    profile = [{"display_name": "1 H100", "slug": "h100-1", "kubespawner_override": {
        "extra_resource_limits": {"nvidia.com/gpu": "1"},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
        "cpu_limit": 1, "mem_limit": "1G"}}]
    c = Config()
    c.GPULedger.db_url = url
    c.GPULedger.pool = "kubernetes"
    for cls in ("KubeSpawner", "KubeGPUSpawner"):
        c[cls].profile_list = profile
        c[cls].enable_user_namespaces = True
        c[cls].user_namespace_template = "gpulab-{username}"
        c[cls].storage_pvc_ensure = False
        c[cls].start_timeout = 60
    c.KubeSpawner.tolerations = [GPU_TOLERATION]
    # the namespace as the hub's admission policy lets it make one (gpulab's labels)
    c.KubeSpawner.user_namespace_labels = {
        "app.kubernetes.io/managed-by": "gpulab", "gpulab.io/user": "{username}",
        "pod-security.kubernetes.io/enforce": "baseline"}
    c.KubeGPUSpawner.kueue = True
    c.KubeGPUSpawner.gpu_quota_sync_interval = 600  # no pass of the mirror while counting
    c.KubeGPUSpawner.k8s_api_request_timeout = 30  # no request sent again for a slow answer
    GPULedger.clear_instance()

    counted: list[tuple[str, str]] = []
    real = rest.RESTClientObject.request

    async def counting(self, method, url, query_params=None, *args, **kwargs):
        if not any(k == "watch" and str(v).lower() == "true" for k, v in (query_params or [])):
            counted.append((method, url.split("?")[0]))
        return await real(self, method, url, query_params, *args, **kwargs)

    monkeypatch.setattr(rest.RESTClientObject, "request", counting)

    def spawner(cls, name):
        s = cls(config=c, user=SimpleNamespace(name=name, id=1, url=f"/user/{name}/", groups=[]),
                hub=Hub(), api_token="not-a-token", oauth_client_id=f"jupyterhub-user-{name}")
        s.user_options = {"profile": "h100-1"}
        return s

    async def requests_of_a_spawn(s):
        counted.clear()
        await asyncio.wait_for(s.start(), 60)
        made = list(counted)
        await s.stop(now=True)
        s.clear_state()
        s.user_options = {"profile": "h100-1"}
        return made

    gpulab = spawner(KubeGPUSpawner, user)
    stock = spawner(KubeSpawner, f"{user}-stock")
    try:
        # the shared watches and Kueue's shared objects (once per hub, not per spawn)
        await gpulab._start_watching_pods()
        await gpulab._start_watching_events()
        await gpulab.kueue_mirror(await asyncio.to_thread(hub_ledger, c, False)).sync_capacity(
            force=True)

        # distinct requests: one sent again (a new namespace's controllers lag under load,
        # and the spawner creates the pod again) is the same request
        first = sorted(set(await requests_of_a_spawn(gpulab)))
        shapes = collections.Counter(
            (m, u.rsplit("/", 2)[-2] if m != "POST" else u.rsplit("/", 1)[-1]) for m, u in first)
        assert shapes == {("PATCH", "namespaces"): 1, ("PATCH", "networkpolicies"): 2,
                          ("PATCH", "serviceaccounts"): 1,
                          ("PATCH", "clusterqueues"): 1, ("PATCH", "localqueues"): 1,
                          ("POST", "pods"): 1}, first
        again = sorted(set(await requests_of_a_spawn(gpulab)))
        # stock KubeSpawner fails a pod in a namespace whose ServiceAccount is not made yet
        await asyncio.to_thread(cp.create_namespace, stock.namespace,
                                labels=stock._expand_all(stock.user_namespace_labels))
        base = await requests_of_a_spawn(stock)
        assert len(base) == 2, base  # stock: the namespace, the pod
        assert len(again) <= len(base) + 2, again
        # (+5 with the namespace's default ServiceAccount, made so that the API server need
        # not wait for the controller-manager's before admitting the pod)
        assert len(first) <= len(base) + 5, first
        assert not [r for r in first + again if r[0] == "GET"], first + again
    finally:
        for s in (gpulab, stock):
            try:
                await s.stop(now=True)
            except Exception:  # noqa: BLE001 - best effort
                pass
        await KubeGPUSpawner._stop_all_reflectors()
        for mirrors in (GPUQuotaMirror._instances, KueueMirror._instances):
            for mirror in list(mirrors.values()):
                if mirror._task is not None:
                    mirror._task.cancel()
            mirrors.clear()
        GPULedger.clear_instance()
        for ns in (gpulab.namespace, stock.namespace):
            cp.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cp.kubectl("delete", "clusterqueue", gpulab.namespace, f"{gpulab.namespace}.preemptible",
                   "--wait=false", check=False)
