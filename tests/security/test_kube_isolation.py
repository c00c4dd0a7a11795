"""Issue 12 on Kubernetes, attacked on the test control plane (tests/cluster): the same promise
that users never reach each other, and the hub's own rights limited to what gpulab owns.

The attacker here is whoever holds the hub's credentials (a token of the ServiceAccount bound
by exactly helm-values/rbac.yaml, as the cluster tests use it: a hub compromised through a
bug, or its token read from a backup), and eve, whose pods share the cluster with vic's. Each
test shows that RBAC alone would allow the attack (``kubectl auth can-i``), that it fails, and
that the victim (kube-system, a namespace of another team, vic's namespace, pods and
policies) is untouched.

The control plane has no pod network (kwok plays the kubelets), so no packet can be sent
between pods: the NetworkPolicies gpulab stored are read back from the API server and what
they let through is decided by `tests.cluster.netpol` (the NetworkPolicy semantics of the
Kubernetes documentation). Likewise what a replica really runs is the kubelet's ``$(VAR)``
expansion (`tests.cluster.kubelet`) of the Job gpulab stored.

Needs the control-plane binaries (tests/cluster/build.sh): without them the fixture fails with
build.sh's reason, as in the cluster tier.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from types import SimpleNamespace

import pytest
import yaml
from jupyterhub.objects import Hub
from kubernetes_asyncio.config import kube_config
from kubespawner.clients import load_config
from traitlets.config import Config

from gpulab.hub.jobs.spec import parse_spec
from gpulab.hub.jobs.kube import KubeJobBackend
from gpulab.hub.quota.policy import Quota
from gpulab.spawner.kube import GPUQuotaMirror, KubeGPUSpawner
from gpulab.hub.cluster.kubeobjects import make_user_namespace
from gpulab.hub.quota.settings import GPULedger
from gpulab.spawner.mixin import hub_ledger
from tests.cluster import hubrbac
from tests.cluster.conftest import _build
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubelet import expand
from tests.cluster.netpol import Endpoint, allowed

pytestmark = [pytest.mark.cluster, pytest.mark.security]

HUB_NAMESPACE = "gpulab-hub-sec"
POLICY = hubrbac.POLICY
OTHER_TEAM = "team-vic"  # a namespace of another team on the same cluster, not gpulab's
PROFILES = [{"display_name": "CPU only", "slug": "cpu", "default": True}]
BAD_POD = {  # what a stolen hub token would make: root on the node
    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "evil"},
    "spec": {"hostPID": True, "containers": [{
        "name": "x", "image": "registry.invalid/x:1", "securityContext": {"privileged": True},
        "volumeMounts": [{"name": "root", "mountPath": "/host"}]}],
        "volumes": [{"name": "root", "hostPath": {"path": "/"}}]},
}


@pytest.fixture(scope="module")
def cp(request):
    """A control plane of this module's own (default kwok Stages: pods run at once)."""
    _build(request.config)
    plane = ControlPlane()
    plane.start()
    yield plane
    plane.stop()


@pytest.fixture(scope="module")
def hub_kubeconfig(cp):
    return hubrbac.hub_kubeconfig(cp, HUB_NAMESPACE)


@pytest.fixture(scope="module")
def other_team(cp):
    """Another team's namespace with a running pod of theirs (made by a cluster admin)."""
    cp.create_namespace(OTHER_TEAM, labels={"team": "vic"})
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vic-app"},
           "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]}}
    _, made = cp.api("POST", f"/api/v1/namespaces/{OTHER_TEAM}/pods", pod, expect=(201,))
    return made["metadata"]["uid"]


def hub(cp, kubeconfig, *args, body: dict | None = None):
    """kubectl as the hub's ServiceAccount."""
    return cp.kubectl(*args, input=yaml.safe_dump(body) if body else None, check=False,
                      kubeconfig=kubeconfig)


def rbac_allows(cp, kubeconfig, verb, resource, namespace=None) -> bool:
    ns = ["-n", namespace] if namespace else []
    return hub(cp, kubeconfig, "auth", "can-i", verb, resource, *ns).stdout.strip() == "yes"


def refused_by_policy(r) -> bool:
    return r.returncode != 0 and POLICY in r.stderr and "denied" in r.stderr


def labels_of(cp, ns) -> dict:
    return cp.api("GET", f"/api/v1/namespaces/{ns}", expect=(200,))[1]["metadata"]["labels"]


# -- the hub's rights: only namespaces gpulab owns --------------------------------------------


def test_the_hubs_credentials_cannot_make_a_pod_in_kube_system(cp, hub_kubeconfig, other_team):
    kc = hub_kubeconfig
    for ns in ("kube-system", OTHER_TEAM):
        assert rbac_allows(cp, kc, "create", "pods", ns)  # RBAC alone would let it
        r = hub(cp, kc, "create", "-n", ns, "-f", "-", body=BAD_POD)
        assert refused_by_policy(r), r.stderr
        assert f"not in namespace {ns}" in r.stderr, r.stderr
        assert cp.api("GET", f"/api/v1/namespaces/{ns}/pods/evil")[0] == 404
    # nor delete another team's pod, nor put a ConfigMap, Service or Job in its namespace
    assert rbac_allows(cp, kc, "delete", "pods", OTHER_TEAM)
    r = hub(cp, kc, "delete", "pod", "vic-app", "-n", OTHER_TEAM, "--wait=false")
    assert refused_by_policy(r), r.stderr
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "evil"}}
    assert refused_by_policy(hub(cp, kc, "create", "-n", OTHER_TEAM, "-f", "-", body=cm))
    # the victims are untouched
    _, pod = cp.api("GET", f"/api/v1/namespaces/{OTHER_TEAM}/pods/vic-app", expect=(200,))
    assert pod["metadata"]["uid"] == other_team and not pod["metadata"].get("deletionTimestamp")
    assert cp.api("GET", f"/api/v1/namespaces/{OTHER_TEAM}/configmaps/evil")[0] == 404


def test_the_hubs_credentials_cannot_relabel_a_namespace_gpulab_does_not_own(
        cp, hub_kubeconfig, other_team):
    kc = hub_kubeconfig
    assert rbac_allows(cp, kc, "patch", "namespaces")
    before = {ns: labels_of(cp, ns) for ns in ("kube-system", OTHER_TEAM)}
    for ns in before:
        # lift Pod Security (then a privileged pod would pass) ...
        r = hub(cp, kc, "label", "namespace", ns, "--overwrite",
                "pod-security.kubernetes.io/enforce=privileged")
        assert refused_by_policy(r), r.stderr
        # ... or take it over: label it as gpulab's, by hand or as the spawner applies its own
        r = hub(cp, kc, "label", "namespace", ns, "app.kubernetes.io/managed-by=gpulab",
                "gpulab.io/user=eve")
        assert refused_by_policy(r), r.stderr
        r = hub(cp, kc, "apply", "--server-side", "--force-conflicts",
                "--field-manager=gpulab-hub", "-f", "-",
                body=make_user_namespace(name=ns, user_label="eve"))
        assert refused_by_policy(r), r.stderr
    assert {ns: labels_of(cp, ns) for ns in before} == before
    # a namespace is made only as gpulab's, with Pod Security enforced
    stray = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "stray-ns"}}
    assert refused_by_policy(hub(cp, kc, "create", "-f", "-", body=stray))
    privileged = make_user_namespace(name="gpulab-stray", user_label="stray",
                                     pod_security="privileged")
    assert refused_by_policy(hub(cp, kc, "create", "-f", "-", body=privileged))
    for ns in ("stray-ns", "gpulab-stray"):
        assert cp.api("GET", f"/api/v1/namespaces/{ns}")[0] == 404


def test_the_hubs_credentials_cannot_make_a_user_namespace_privileged(cp, hub_kubeconfig):
    kc = hub_kubeconfig
    ns = f"gpulab-u{uuid.uuid4().hex[:6]}"
    r = hub(cp, kc, "apply", "--server-side", "--field-manager=gpulab-hub", "-f", "-",
            body=make_user_namespace(name=ns, user_label="vic"))
    assert r.returncode == 0, r.stderr  # its own work: allowed
    before = labels_of(cp, ns)
    r = hub(cp, kc, "label", "namespace", ns, "--overwrite",
            "pod-security.kubernetes.io/enforce=privileged")
    assert refused_by_policy(r), r.stderr
    r = hub(cp, kc, "label", "namespace", ns, "pod-security.kubernetes.io/enforce-")
    assert refused_by_policy(r), r.stderr
    r = hub(cp, kc, "label", "namespace", ns, "app.kubernetes.io/managed-by-")  # disown it
    assert refused_by_policy(r), r.stderr
    assert labels_of(cp, ns) == before
    # so Pod Security keeps refusing a privileged pod there
    r = hub(cp, kc, "create", "-n", ns, "-f", "-", body=BAD_POD)
    assert r.returncode != 0 and 'violates PodSecurity "baseline:latest"' in r.stderr, r.stderr


def test_the_hubs_credentials_cannot_give_work_a_priority_nor_namespaces_foreign_labels(
        cp, hub_kubeconfig):
    """Issue 33: with the hub's credentials a pod with ``priorityClassName:
    system-node-critical`` was made in a gpulab namespace (and Kueue admitted it at priority
    2000001000, above every person's work), and batch Jobs could carry any priority. Now no
    kind the hub may write takes a PriorityClass or a Kueue priority but gpulab's own, in its
    metadata or its pod template, and the hub labels its namespaces with gpulab's keys only.
    Server-side dry runs: the admission policy decides, nothing is stored either way."""
    kc = hub_kubeconfig
    ns = f"gpulab-u{uuid.uuid4().hex[:6]}"
    r = hub(cp, kc, "apply", "--server-side", "--field-manager=gpulab-hub", "-f", "-",
            body=make_user_namespace(name=ns, user_label="eve"))
    assert r.returncode == 0, r.stderr
    container = {"name": "c", "image": "registry.invalid/x:1"}
    high = {"kueue.x-k8s.io/priority-class": "system-cluster-critical"}

    def job(pod_spec_extra=None, labels=None, template_labels=None):
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": "vip", **({"labels": labels} if labels else {})},
                "spec": {"template": {
                    "metadata": {"labels": template_labels or {}},
                    "spec": {"restartPolicy": "Never", "containers": [container],
                             **(pod_spec_extra or {})}}}}

    forged = {
        "pod with a PriorityClass": {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vip"},
            "spec": {"priorityClassName": "system-node-critical", "containers": [container]}},
        "pod with a Kueue priority": {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vip", "labels": high},
            "spec": {"containers": [container]}},
        "Job whose pods have a PriorityClass": job({"priorityClassName": "system-node-critical"}),
        "Job with a Kueue priority": job(labels=high),
        "Job whose pods have a Kueue priority": job(template_labels=high),
    }
    for what, obj in forged.items():
        resource = "pods" if obj["kind"] == "Pod" else "jobs"
        assert rbac_allows(cp, kc, "create", resource, ns), what  # RBAC alone would let it
        r = hub(cp, kc, "create", "--dry-run=server", "-n", ns, "-f", "-", body=obj)
        assert refused_by_policy(r), (what, r.stderr)
        assert "no priority but gpulab-preemptible" in r.stderr, (what, r.stderr)
    # gpulab's own kind of work passes the same policy (no priority at all)
    r = hub(cp, kc, "create", "--dry-run=server", "-n", ns, "-f", "-", body=job())
    assert r.returncode == 0, r.stderr
    # its namespace: gpulab's keys only, never another controller's
    before = labels_of(cp, ns)
    for label in ("istio-injection=enabled", "kueue.x-k8s.io/managed=true"):
        r = hub(cp, kc, "label", "namespace", ns, label)
        assert refused_by_policy(r), (label, r.stderr)
        assert "only with gpulab's keys" in r.stderr, r.stderr
    assert labels_of(cp, ns) == before
    # a label a cluster admin put there does not stop the hub's own apply
    cp.kubectl("label", "namespace", ns, "team=ml")
    r = hub(cp, kc, "apply", "--server-side", "--field-manager=gpulab-hub", "-f", "-",
            body=make_user_namespace(name=ns, user_label="eve"))
    assert r.returncode == 0, r.stderr
    assert labels_of(cp, ns)["team"] == "ml"


# -- the hub still does its work; users' pods are apart -------------------------------------


@pytest.fixture
async def hub_side(cp, hub_kubeconfig, tmp_path, monkeypatch):
    """KubeGPUSpawners and a KubeJobBackend as the hub's ServiceAccount, with one ledger."""
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", hub_kubeconfig)
    load_config.cache_clear()
    cfg = Config()
    cfg.GPULedger.db_url = f"sqlite:///{tmp_path / 'gpulab.sqlite'}"
    cfg.GPULedger.pool = "kubernetes"
    GPULedger.clear_instance()
    ledger = hub_ledger(cfg, assigns_devices=False)
    made: list[KubeGPUSpawner] = []

    def spawner(name: str) -> KubeGPUSpawner:
        c = copy.deepcopy(cfg)
        c.KubeGPUSpawner.profile_list = PROFILES
        c.KubeGPUSpawner.storage_pvc_ensure = False
        c.KubeGPUSpawner.start_timeout = 60
        c.KubeGPUSpawner.user_namespace_template = "gpulab-{username}"
        c.KubeGPUSpawner.hub_namespace = HUB_NAMESPACE
        user = SimpleNamespace(name=name, id=len(made) + 1, url=f"/user/{name}/", groups=[])
        s = KubeGPUSpawner(config=c, user=user, hub=Hub(), api_token="not-a-token",
                           oauth_client_id=f"jupyterhub-user-{name}")
        s.user_options = {"profile": "cpu"}
        made.append(s)
        return s

    c = Config()
    c.KubeJobBackend.hub_namespace = HUB_NAMESPACE
    c.KubeJobBackend.reconcile_interval = 0.2
    jobs = KubeJobBackend(ledger, config=c)
    yield SimpleNamespace(ledger=ledger, spawner=spawner, jobs=jobs)
    for s in made:
        try:
            await s.stop(now=True)
        except Exception:  # noqa: BLE001 - best effort; the control plane goes with the module
            pass
    await KubeGPUSpawner._stop_all_reflectors()
    await jobs.shutdown()
    for mirror in list(GPUQuotaMirror._instances.values()):
        if mirror._task is not None:
            mirror._task.cancel()
    GPUQuotaMirror._instances.clear()
    GPULedger.clear_instance()


def tf_job(name: str, **kw):
    return parse_spec({"name": name, "strategy": "parameter-server",
                       "replicas": {"chief": 1, "ps": 1, "worker": 2},
                       "source": "print('hi')", **kw})


async def test_users_pods_reach_each_other_only_through_the_hub(cp, hub_side):
    """vic's and eve's servers and jobs, made by the hub's own credentials (the admission
    policy lets it work in gpulab's namespaces): the policies it stored keep every pod of one
    person away from the other's, and a job's TF servers away from everything but the job."""
    vic, eve = f"vic{uuid.uuid4().hex[:4]}", f"eve{uuid.uuid4().hex[:4]}"
    pods = {}
    for name in (vic, eve):
        hub_side.ledger.set_quota("user", name, Quota(max_gpus=4), actor="admin")
        s = hub_side.spawner(name)
        await asyncio.wait_for(s.start(), 60)
        pods[name] = cp.api("GET", f"/api/v1/namespaces/{s.namespace}/pods/{s.pod_name}",
                            expect=(200,))[1]
        for job in ("a", "b"):
            view = await hub_side.jobs.submit(name, (), tf_job(job))
            assert view["namespace"] == s.namespace
    policies = []
    for name in (vic, eve):
        _, body = cp.api("GET", f"/apis/networking.k8s.io/v1/namespaces/gpulab-{name}"
                         "/networkpolicies", expect=(200,))
        policies += body["items"]
    assert len(policies) == 8  # per namespace: user pods, servers, and one per job

    def ns_labels(ns):
        return labels_of(cp, ns)

    def pod_endpoint(pod):
        ns = pod["metadata"]["namespace"]
        return Endpoint(ns, pod["metadata"]["labels"], ns_labels(ns))

    def replica(user, job, role):
        ns = f"gpulab-{user}"
        _, body = cp.api("GET", f"/apis/batch/v1/namespaces/{ns}/jobs/{job}-{role}", expect=(200,))
        return Endpoint(ns, body["spec"]["template"]["metadata"]["labels"], ns_labels(ns))

    hub_ns = ns_labels(HUB_NAMESPACE)
    proxy = Endpoint(HUB_NAMESPACE, {"component": "proxy"}, hub_ns)
    hub_pod = Endpoint(HUB_NAMESPACE, {"component": "hub"}, hub_ns)
    vic_server, eve_server = pod_endpoint(pods[vic]), pod_endpoint(pods[eve])
    vic_worker, vic_ps = replica(vic, "a", "worker"), replica(vic, "a", "ps")
    eve_worker = replica(eve, "a", "worker")
    # the attacks: eve's server and eve's replicas at vic's server and vic's TF servers, vic's
    # other job at this one's, anyone at the cloud metadata server
    for src, dst, port in ((eve_server, vic_server, 8888), (eve_worker, vic_server, 8888),
                           (eve_server, vic_ps, 2222), (eve_worker, vic_ps, 2222),
                           (vic_server, vic_ps, 2222), (replica(vic, "b", "worker"), vic_ps, 2222),
                           (hub_pod, vic_ps, 2222), (proxy, vic_ps, 2222),
                           (eve_server, proxy, 8001), (eve_worker, hub_pod, 5432),
                           (vic_worker, Endpoint.address("169.254.169.254"), 80),
                           (eve_server, Endpoint.address("169.254.169.254"), 80),
                           (eve_server, Endpoint.address("1.1.1.1"), 443)):
        assert not allowed(policies, src, dst, port), (src, dst, port)
    # what must keep working: the proxy and the hub to the servers, a job's own replicas to
    # each other, every pod to DNS and to the hub's API and the gpulab service
    dns = Endpoint("kube-system", {"k8s-app": "kube-dns"}, ns_labels("kube-system"))
    for src, dst, port, proto in ((proxy, vic_server, 8888, "TCP"),
                                  (hub_pod, eve_server, 8888, "TCP"),
                                  (vic_worker, vic_ps, 2222, "TCP"),
                                  (replica(vic, "a", "chief"), vic_worker, 2222, "TCP"),
                                  (vic_server, dns, 53, "UDP"), (eve_worker, dns, 53, "TCP"),
                                  (vic_server, hub_pod, 8081, "TCP"),
                                  (eve_server, hub_pod, 8002, "TCP")):
        assert allowed(policies, src, dst, port, proto), (src, dst, port)
    # vic's server is still running, in vic's namespace, untouched by eve's spawn and jobs
    again = cp.api("GET", f"/api/v1/namespaces/gpulab-{vic}/pods/{pods[vic]['metadata']['name']}",
                   expect=(200,))[1]
    assert again["metadata"]["uid"] == pods[vic]["metadata"]["uid"]
    assert again["status"]["phase"] == "Running"


async def test_only_its_owners_notebook_reaches_a_held_cluster(cp, hub_side, other_team):
    """Issue 38: vic holds a cluster (TF servers that run any graph they are sent) and his
    notebook pod, made by KubeGPUSpawner, reaches them on the TF port by the policies the hub
    stored. eve's notebook, eve's job and eve's own cluster, vic's own training job, and a
    pod of another team's namespace labelled as vic's notebook and as his cluster's replica
    cannot connect; nor does vic's notebook reach them on another port."""
    vic, eve = f"vic{uuid.uuid4().hex[:4]}", f"eve{uuid.uuid4().hex[:4]}"
    servers = {}
    for name in (vic, eve):
        hub_side.ledger.set_quota("user", name, Quota(max_gpus=4), actor="admin")
        s = hub_side.spawner(name)
        await asyncio.wait_for(s.start(), 60)
        servers[name] = cp.api("GET", f"/api/v1/namespaces/{s.namespace}/pods/{s.pod_name}",
                               expect=(200,))[1]
        await hub_side.jobs.submit(name, (), parse_spec({
            "name": "held", "kind": "cluster", "strategy": "parameter-server",
            "replicas": {"ps": 1, "worker": 1}}))
        await hub_side.jobs.submit(name, (), tf_job("train"))
    policies = []
    for name in (vic, eve):
        _, body = cp.api("GET", f"/apis/networking.k8s.io/v1/namespaces/gpulab-{name}"
                         "/networkpolicies", expect=(200,))
        policies += body["items"]

    def endpoint(pod_or_template_labels, ns):
        return Endpoint(ns, pod_or_template_labels, labels_of(cp, ns))

    def replica(user, job, role):
        ns = f"gpulab-{user}"
        _, body = cp.api("GET", f"/apis/batch/v1/namespaces/{ns}/jobs/{job}-{role}", expect=(200,))
        return endpoint(body["spec"]["template"]["metadata"]["labels"], ns)

    vic_notebook = endpoint(servers[vic]["metadata"]["labels"], f"gpulab-{vic}")
    eve_notebook = endpoint(servers[eve]["metadata"]["labels"], f"gpulab-{eve}")
    vic_ps, vic_worker = replica(vic, "held", "ps"), replica(vic, "held", "worker")
    assert allowed(policies, vic_notebook, vic_ps, 2222)
    assert allowed(policies, vic_notebook, vic_worker, 2222)
    assert allowed(policies, vic_worker, vic_ps, 2222)
    intruders = {
        "eve's notebook": eve_notebook,
        "eve's job": replica(eve, "train", "chief"),
        "eve's cluster": replica(eve, "held", "worker"),
        "vic's own job": replica(vic, "train", "chief"),
        "another team's pod, labelled as vic's notebook": endpoint(
            servers[vic]["metadata"]["labels"], OTHER_TEAM),
        "another team's pod, labelled as vic's replica": endpoint(
            {"gpulab.io/user": vic.lower(), "gpulab.io/job": "held"}, OTHER_TEAM),
    }
    for who, src in intruders.items():
        for dst in (vic_ps, vic_worker):
            assert not allowed(policies, src, dst, 2222), who
    assert not allowed(policies, vic_notebook, vic_ps, 22)
    assert not allowed(policies, vic_ps, vic_notebook, 8888)  # the servers reach not back


async def test_job_args_reach_the_replica_as_written(cp, hub_side):
    """A person's args that look like the kubelet's $(VAR) references are passed on as
    written: the Job gpulab stored escapes them, so the replica gets neither TF_CONFIG nor
    another variable's value in their place."""
    u = f"ann{uuid.uuid4().hex[:4]}"
    hub_side.ledger.set_quota("user", u, Quota(max_gpus=4), actor="admin")
    args = ["--out=$(TF_CONFIG)", "$$(GPULAB_JOB_DIR)", "$(GPULAB_TASK_INDEX", "cost$"]
    env = {"NOTE": "$(PYTHONUNBUFFERED)"}
    await hub_side.jobs.submit(u, (), tf_job("dollar", args=args, env=env))
    _, job = cp.api("GET", f"/apis/batch/v1/namespaces/gpulab-{u}/jobs/dollar-worker",
                    expect=(200,))
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][-4:] == ["--out=$$(TF_CONFIG)", "$$$$(GPULAB_JOB_DIR)",
                                 "$$(GPULAB_TASK_INDEX", "cost$$"]
    variables = {e["name"]: e.get("value", "") for e in c["env"]}
    variables["GPULAB_TASK_INDEX"] = "1"
    values = {k: expand(v, variables) for k, v in variables.items()}  # env, in order
    assert [expand(a, values) for a in c["command"][-4:]] == args
    assert expand(variables["NOTE"], values) == env["NOTE"]
    assert json.loads(values["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}
