"""KubeGPUSpawner against the real control plane, as the hub's ServiceAccount bound by exactly
helm-values/rbac.yaml (not as cluster admin), with a real quota ledger (SQLite)."""

import asyncio
import copy
import html
import json
import re
import threading
import time
import uuid
from types import SimpleNamespace

import jinja2
import pytest
from jupyterhub.objects import Hub
from kubernetes_asyncio.config import kube_config
from kubespawner.clients import load_config
from traitlets.config import Config

from gpulab.hub.quota.ledger import Ledger, Request
from gpulab.hub.quota.policy import Quota
from gpulab.spawner.kube import GPUQuotaMirror, KubeGPUSpawner
from gpulab.hub.cluster.kubeobjects import make_user_network_policies
from gpulab.hub.quota.settings import GPULedger
from gpulab.spawner.mixin import SpawnRefused, hub_ledger

from . import hubrbac
from .controlplane import GPU_TOLERATION

pytestmark = pytest.mark.cluster

HUB_NAMESPACE = "gpulab-hub-test"
SHARED = {"nfs": {"server": "nfs.invalid", "path": "/gpulab"}}


def h100(n, **extra):
    return {"display_name": f"{n} H100", "slug": f"h100-{n}",
            "kubespawner_override": {
                "extra_resource_limits": {"nvidia.com/gpu": str(n)},
                "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
                "cpu_limit": 2, "mem_limit": "4G", **extra}}


PROFILES = [
    {"display_name": "CPU only", "slug": "cpu", "default": True},
    h100(2),
    h100(9),
    {"display_name": "1 B200", "slug": "b200-1", "kubespawner_override": {
        "extra_resource_limits": {"nvidia.com/gpu": "1"},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-B200"}}},
    {**h100(1, privileged=True, allow_privilege_escalation=True), "slug": "tampered-privileged"},
    {**h100(1, volumes=[{"name": "host", "hostPath": {"path": "/"}}],
            volume_mounts=[{"name": "host", "mountPath": "/host"}]), "slug": "tampered-hostpath"},
]


@pytest.fixture(scope="module")
def hub_kubeconfig(control_plane):
    """A kubeconfig of ServiceAccount hub, bound by helm-values/rbac.yaml and nothing else
    (its admission policy too: the hub writes only in namespaces gpulab owns)."""
    return hubrbac.hub_kubeconfig(control_plane, HUB_NAMESPACE)


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    db = tmp_path_factory.mktemp("ledger") / "gpulab.sqlite"
    cfg = Config()
    cfg.GPULedger.db_url = f"sqlite:///{db}"
    cfg.GPULedger.pool = "kubernetes"
    GPULedger.clear_instance()
    ledger = hub_ledger(cfg, assigns_devices=False)
    yield cfg, ledger
    GPULedger.clear_instance()


@pytest.fixture
async def make_spawner(hub_kubeconfig, ledger, monkeypatch):
    """Makes KubeGPUSpawners for fresh users; stops their pods and the shared watches after."""
    # as KUBECONFIG would in the hub's environment (kubernetes_asyncio reads it at import)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", hub_kubeconfig)
    load_config.cache_clear()
    cfg, _ = ledger
    made = []

    def make(*, profile_list=PROFILES, name=None, **traits):
        c = copy.deepcopy(cfg)
        name = name or f"u{uuid.uuid4().hex[:6]}"
        c.KubeGPUSpawner.profile_list = profile_list
        c.KubeGPUSpawner.shared_volume = SHARED
        c.KubeGPUSpawner.user_namespace_template = "gpulab-{username}"
        c.KubeGPUSpawner.start_timeout = 60
        c.KubeGPUSpawner.gpu_quota_sync_interval = 0.5
        for k, v in traits.items():
            setattr(c.KubeGPUSpawner, k, v)
        user = SimpleNamespace(name=name, id=len(made) + 1, url=f"/user/{name}/", groups=[])
        s = KubeGPUSpawner(config=c, user=user, hub=Hub(), api_token="not-a-token",
                           oauth_client_id=f"jupyterhub-user-{name}")
        made.append(s)
        return s

    yield make
    for s in made:
        try:
            await s.stop(now=True)
        except Exception:  # noqa: BLE001 - best effort; the namespace goes with the session
            pass
        s.clear_state()
    await KubeGPUSpawner._stop_all_reflectors()
    for mirror in list(GPUQuotaMirror._instances.values()):
        if mirror._task is not None:
            mirror._task.cancel()
    GPUQuotaMirror._instances.clear()


def home_pv(cp, spawner):
    """A PersistentVolume pre-bound to the spawner's home claim (the test cluster has no
    provisioner)."""
    cp.apply({
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": f"home-{spawner.namespace}"},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"],
                 "persistentVolumeReclaimPolicy": "Delete",
                 "nfs": {"server": "nfs.invalid", "path": f"/homes/{spawner.user.name}"},
                 "claimRef": {"namespace": spawner.namespace, "name": spawner.pvc_name}},
    })


def get(cp, path):
    status, body = cp.api("GET", path)
    return body if status == 200 else None


async def eventually(check, timeout=30, what="a condition"):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.2)


def quota_of(cp, ns):
    return get(cp, f"/api/v1/namespaces/{ns}/resourcequotas/gpulab-gpus")


async def test_spawn_makes_the_pod_binds_it_to_h100_and_stop_frees_the_quota(
        control_plane, make_spawner, ledger):
    cp = control_plane
    _, led = ledger
    s = make_spawner()
    led.set_quota("user", s.user.name, Quota(max_gpus=4), actor="admin")
    home_pv(cp, s)
    s.user_options = {"profile": "h100-2"}

    url = await asyncio.wait_for(s.start(), 90)

    ns, name = s.namespace, s.pod_name
    assert ns == f"gpulab-{s.user.name}"
    pod = get(cp, f"/api/v1/namespaces/{ns}/pods/{name}")
    assert url == f"http://{pod['status']['podIP']}:8888"
    spec = pod["spec"]
    assert spec["nodeName"].startswith("gpu-h100-"), spec["nodeName"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100"}
    assert [t for t in spec["tolerations"] if t["key"] == "nvidia.com/gpu"] == [GPU_TOLERATION]
    assert spec["automountServiceAccountToken"] is False
    assert not any(v["name"].startswith("kube-api-access") for v in spec["volumes"])
    (c,) = spec["containers"]
    assert c["name"] == "notebook"
    # the profile's CPU, memory and GPUs; the operator's container defaults add the
    # ephemeral storage the profile does not set (issue 36), in the pod as the hub sends it
    assert c["resources"] == {
        "limits": {"cpu": "2", "memory": "4294967296", "nvidia.com/gpu": "2",  # 4G: 4 GiB
                   "ephemeral-storage": "20Gi"},
        "requests": {"cpu": "2", "memory": "4294967296", "nvidia.com/gpu": "2",
                     "ephemeral-storage": "1Gi"},
    }
    assert sorted(spec["volumes"], key=lambda v: v["name"]) == [
        {"name": "gpulab-shared", "nfs": {"server": "nfs.invalid", "path": "/gpulab"}},
        {"name": "home", "persistentVolumeClaim": {"claimName": s.pvc_name}},
    ]
    assert c["volumeMounts"] == [
        {"name": "home", "mountPath": "/home/jovyan"},
        {"name": "gpulab-shared", "mountPath": f"/gpulab/shared/users/{s.user.name}",
         "subPath": f"users/{s.user.name}"},
        {"name": "gpulab-shared", "mountPath": "/gpulab/shared/datasets", "subPath": "datasets",
         "readOnly": True},
    ]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["GPULAB_USER_DIR"] == f"/gpulab/shared/users/{s.user.name}"
    assert env["GPULAB_DATASETS_DIR"] == "/gpulab/shared/datasets"
    assert pod["status"]["phase"] == "Running"

    labels = get(cp, f"/api/v1/namespaces/{ns}")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    assert labels["gpulab.io/user"] == s.user.name

    rq = await eventually(lambda: (lambda q: q if q.get("status", {}).get("used", {}).get(
        "requests.nvidia.com/gpu") == "2" else None)(quota_of(cp, ns)), what="quota used 2")
    assert rq["spec"]["hard"] == {"requests.nvidia.com/gpu": "4"}
    (alloc,) = led.open_allocations(user=s.user.name)
    assert (alloc.kind, alloc.holder, alloc.gpus, alloc.model) == ("notebook", "default", 2, "NVIDIA-H100")

    await s.stop()
    s.clear_state()
    assert cp.api("GET", f"/api/v1/namespaces/{ns}/pods/{name}")[0] == 404
    await eventually(lambda: quota_of(cp, ns)["status"]["used"]["requests.nvidia.com/gpu"] == "0",
                     what="quota used back to 0")
    assert led.open_allocations(user=s.user.name) == []

    # the GPU profile's overrides are undone: the next server, CPU only, asks for no GPU
    s.user_options = {"profile": "cpu"}
    await asyncio.wait_for(s.start(), 90)
    spec = get(cp, f"/api/v1/namespaces/{ns}/pods/{name}")["spec"]
    assert spec["nodeName"] == "cpu-0"
    assert not spec.get("nodeSelector")
    assert not [t for t in spec["tolerations"] if t["key"] == "nvidia.com/gpu"]
    # no GPU; the CPU, memory and disk a profile without limits gets from its namespace
    assert spec["containers"][0].get("resources", {}) == {
        "limits": {"cpu": "2", "memory": "8Gi", "ephemeral-storage": "20Gi"},
        "requests": {"cpu": "100m", "memory": "512Mi", "ephemeral-storage": "1Gi"}}
    assert led.open_allocations(user=s.user.name) == []  # no GPU, no allocation
    await s.stop()
    s.clear_state()


async def test_a_pod_create_answered_late_is_kept_not_deleted(control_plane, make_spawner, ledger):
    """Under load a pod create can time out on the hub's side and be made all the same: the
    next try meets 409. KubeSpawner deletes the pod in the way and creates again, and a late
    DELETE of that could remove the new pod (a spawn of 500 stuck until start_timeout,
    bench/scale_kube.py). KubeGPUSpawner keeps its own start's pod: made once, never deleted,
    the start's GPUs held."""
    cp = control_plane
    _, led = ledger
    s = make_spawner(storage_pvc_ensure=False)
    led.set_quota("user", s.user.name, Quota(max_gpus=4), actor="admin")
    s.user_options = {"profile": "h100-2"}
    real, made, deleted = s.api, [], []

    class LateAnswers:  # the hub's API client, its first pod create answered too late
        def __getattr__(self, name):
            return getattr(real, name)

        async def create_namespaced_pod(self, namespace, body, **kw):
            pod = await real.create_namespaced_pod(namespace, body, **kw)  # 409 raises here
            made.append(pod.metadata.uid)
            if len(made) == 1:
                raise asyncio.TimeoutError  # as KubeSpawner's wait_for would
            return pod

        async def delete_namespaced_pod(self, *a, **kw):
            deleted.append(a or kw)
            return await real.delete_namespaced_pod(*a, **kw)

    s.api = LateAnswers()
    url = await asyncio.wait_for(s.start(), 90)

    pod = get(cp, f"/api/v1/namespaces/{s.namespace}/pods/{s.pod_name}")
    assert url == f"http://{pod['status']['podIP']}:8888"
    assert made == [pod["metadata"]["uid"]] and deleted == [], (made, deleted)
    (alloc,) = led.open_allocations(user=s.user.name)
    assert alloc.gpus == 2
    s.api = real
    await s.stop()
    s.clear_state()
    assert led.open_allocations(user=s.user.name) == []


NFS_EGRESS = [{"to": [{"ipBlock": {"cidr": "10.0.0.5/32"}}],
               "ports": [{"protocol": "TCP", "port": 2049}]}]


def policies_of(cp, ns) -> dict[str, dict]:
    body = get(cp, f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies")
    return {p["metadata"]["name"]: p for p in body["items"]}


async def test_spawn_makes_and_keeps_the_namespaces_network_policies(control_plane, make_spawner):
    cp = control_plane
    s = make_spawner(storage_pvc_ensure=False, hub_namespace=HUB_NAMESPACE,
                     allowed_egress=NFS_EGRESS)
    s.user_options = {"profile": "cpu"}
    await asyncio.wait_for(s.start(), 60)
    ns = s.namespace
    want = {p["metadata"]["name"]: p for p in make_user_network_policies(
        namespace=ns, user_label=s.user_label, hub_namespace=HUB_NAMESPACE,
        allowed_egress=NFS_EGRESS)}
    stored = policies_of(cp, ns)
    assert sorted(stored) == ["gpulab-servers", "gpulab-user-pods"]
    for name, policy in want.items():
        assert stored[name]["spec"] == policy["spec"], name
        assert stored[name]["metadata"]["labels"] == policy["metadata"]["labels"]
    # the server pod is what the servers' policy selects (KubeSpawner's component label)
    labels = get(cp, f"/api/v1/namespaces/{ns}/pods/{s.pod_name}")["metadata"]["labels"]
    assert labels["component"] == "singleuser-server"
    await s.stop()
    s.clear_state()

    # someone deletes one policy and opens the other to everything: the next spawn puts
    # them back as gpulab wants them, before the pod exists
    base = f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
    cp.api("DELETE", f"{base}/gpulab-servers", expect=(200,))
    cp.api("PATCH", f"{base}/gpulab-user-pods", {"spec": {"egress": [{}], "ingress": [{}]}},
           content_type="application/merge-patch+json", expect=(200,))
    assert policies_of(cp, ns)["gpulab-user-pods"]["spec"]["ingress"] == [{}]
    await asyncio.wait_for(s.start(), 60)
    stored = policies_of(cp, ns)
    for name, policy in want.items():
        assert stored[name]["spec"] == policy["spec"], name
    await s.stop()
    s.clear_state()


async def test_the_namespace_is_prepared_with_the_ledger_read_off_the_event_loop(
        control_plane, make_spawner, ledger, monkeypatch):
    """The quota read of a namespace's preparation (and of the mirror's syncs) runs in a
    worker thread: the hub's event loop never waits for the ledger's lock."""
    cp = control_plane
    _, led = ledger
    s = make_spawner(storage_pvc_ensure=False, hub_namespace=HUB_NAMESPACE)
    led.set_quota("user", s.user.name, Quota(max_gpus=2), actor="admin")
    reads = []
    for name in ("quotas", "effective"):  # the person's own at the spawn, all at a sync
        real = getattr(Ledger, name)

        def spy(self, *args, _real=real, **kwargs):
            reads.append(threading.current_thread())
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Ledger, name, spy)
    await asyncio.wait_for(s._ensure_namespace(), 30)
    assert quota_of(cp, s.namespace)["spec"]["hard"] == {"requests.nvidia.com/gpu": "2"}
    labels = get(cp, f"/api/v1/namespaces/{s.namespace}")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    assert sorted(policies_of(cp, s.namespace)) == ["gpulab-servers", "gpulab-user-pods"]
    led.set_quota("user", s.user.name, Quota(max_gpus=3), actor="admin")
    await eventually(lambda: quota_of(cp, s.namespace)["spec"]["hard"]
                     == {"requests.nvidia.com/gpu": "3"}, timeout=10, what="the mirror's sync")
    assert len(reads) >= 2
    assert all(thread is not threading.current_thread() for thread in reads), reads


async def test_user_options_cannot_change_the_pod(make_spawner):
    s = make_spawner()
    s.user_options = {"profile": "cpu", "volume_mounts": [{"name": "gpulab-shared",
                                                            "mountPath": "/x", "subPath": "users/bob"}]}
    with pytest.raises(SpawnRefused) as e:
        await s.start()
    assert e.value.status_code == 400
    assert "Unknown server option(s): volume_mounts" in e.value.jupyterhub_message


async def test_api_server_refuses_a_pod_over_the_quota_with_the_quota_message(
        control_plane, make_spawner, ledger):
    cp = control_plane
    _, led = ledger
    s = make_spawner()
    led.set_quota("user", s.user.name, Quota(max_gpus=2), actor="admin")
    # a pod the ledger knows nothing of already holds one GPU in the user's namespace (made
    # by an admin for gpulab: labelled as gpulab's, else the hub could not use it)
    cp.create_namespace(s.namespace, labels={
        "app.kubernetes.io/managed-by": "gpulab", "gpulab.io/user": s.user_label,
        "pod-security.kubernetes.io/enforce": "baseline"})
    outside = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "outside"},
               "spec": {"tolerations": [GPU_TOLERATION], "containers": [{
                   "name": "main", "image": "registry.invalid/x:1",
                   "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    cp.api("POST", f"/api/v1/namespaces/{s.namespace}/pods", outside, expect=(201,))
    s.user_options = {"profile": "h100-2"}

    with pytest.raises(SpawnRefused) as e:
        await asyncio.wait_for(s.start(), 60)

    assert e.value.status_code == 403
    assert e.value.jupyterhub_message == (
        f"Quota exceeded: this request needs 2 GPUs and 1 of your 2 GPUs is in use: "
        f"other pods in namespace '{s.namespace}' (1). Stop one of them, ask for fewer GPUs, "
        "or ask an admin for a larger quota.")
    assert led.open_allocations(user=s.user.name) == []  # the ledger's admission was undone


@pytest.mark.parametrize("profile, home, expected", [
    ("h100-9", False,
     r"No node has 9 free GPUs of model NVIDIA-H100 \(most free on one node: [0-8]\); waiting\."),
    ("b200-1", False,
     r"No node has GPUs of model NVIDIA-B200; waiting \(ask an admin which GPU models the "
     r"cluster has\)\."),
    ("cpu", True, r"A storage volume of this server is not ready yet \(not bound to a disk\); "
     r"waiting\."),
], ids=["nine-gpus-on-8-gpu-nodes", "no-such-model", "home-volume-not-bound"])
async def test_why_a_server_waits_reaches_the_progress_stream(make_spawner, ledger, profile, home,
                                                               expected):
    _, led = ledger
    s = make_spawner(storage_pvc_ensure=home)
    led.set_quota("user", s.user.name, Quota(max_gpus=16), actor="admin")
    s.user_options = {"profile": profile}
    start = s.start()
    seen = []
    try:
        async def first_explained():
            async for event in s.progress():
                seen.append(event.get("message", ""))
                if re.fullmatch(expected, seen[-1]):
                    return seen[-1]
        try:
            await asyncio.wait_for(first_explained(), 30)
        except asyncio.TimeoutError:
            raise AssertionError(f"no {expected!r} in the progress events: {seen}") from None
    finally:
        start.cancel()
        with pytest.raises((asyncio.CancelledError, Exception)):
            await start
    assert led.open_allocations(user=s.user.name) == []  # the GPUs went back with the spawn


@pytest.mark.parametrize("profile, violation", [
    ("tampered-privileged", 'privileged (container "notebook" must not set securityContext.privileged=true)'),
    ("tampered-hostpath", 'hostPath volumes (volume "host")'),
])
async def test_pod_security_refuses_a_tampered_profile(make_spawner, profile, violation):
    s = make_spawner(storage_pvc_ensure=False)
    s.user_options = {"profile": profile}
    with pytest.raises(SpawnRefused) as e:
        await asyncio.wait_for(s.start(), 60)
    assert e.value.status_code == 403
    msg = e.value.jupyterhub_message
    assert msg.startswith("The cluster refused this server's pod because it breaks the "
                          "namespace's security policy:"), msg
    assert 'violates PodSecurity "baseline:latest"' in msg and violation in msg, msg


async def test_quota_edits_reach_the_resource_quota_within_seconds(control_plane, make_spawner, ledger):
    cp = control_plane
    _, led = ledger
    s = make_spawner(storage_pvc_ensure=False)
    led.set_quota("user", s.user.name, Quota(max_gpus=1), actor="admin")
    s.user_options = {"profile": "cpu"}
    await asyncio.wait_for(s.start(), 60)
    assert quota_of(cp, s.namespace)["spec"]["hard"] == {"requests.nvidia.com/gpu": "1"}

    t0 = time.monotonic()
    led.set_quota("user", s.user.name, Quota(max_gpus=3), actor="admin")
    await eventually(lambda: quota_of(cp, s.namespace)["spec"]["hard"] == {"requests.nvidia.com/gpu": "3"},
                     timeout=10, what="the ResourceQuota to say 3")
    assert time.monotonic() - t0 < 8  # within seconds (the mirror looks every 0.5 s here)

    led.unset_quota("user", s.user.name, actor="admin")  # no quota at all: no ResourceQuota
    await eventually(lambda: quota_of(cp, s.namespace) is None, timeout=10,
                     what="the ResourceQuota to be deleted")

    # the hub restarts (a new spawner from the saved state): the running server's quota is
    # still mirrored
    for mirror in list(GPUQuotaMirror._instances.values()):
        mirror._task.cancel()
    GPUQuotaMirror._instances.clear()
    again = make_spawner(name=s.user.name, storage_pvc_ensure=False)
    again.load_state(s.get_state())
    led.set_quota("user", s.user.name, Quota(max_gpus=2), actor="admin")
    await eventually(lambda: (quota_of(cp, s.namespace) or {}).get("spec", {}).get("hard")
                     == {"requests.nvidia.com/gpu": "2"}, timeout=10,
                     what="the ResourceQuota to say 2 after the restart")


def test_the_users_pod_identity_can_do_nothing(control_plane):
    """The user namespace's default ServiceAccount (whose token the pod does not even get) may
    not make pods, so nobody can mount another user's sub-path from inside a server."""
    cp = control_plane
    ns = f"gpulab-u{uuid.uuid4().hex[:6]}"
    cp.create_namespace(ns, labels={"pod-security.kubernetes.io/enforce": "baseline"})
    kubeconfig = cp.service_account_kubeconfig(ns, "default", create=False)
    r = cp.kubectl("run", "peek", "--image=registry.invalid/x:1", kubeconfig=kubeconfig, check=False)
    assert r.returncode != 0 and "(Forbidden)" in r.stderr, r.stderr


def test_the_hub_token_is_not_cluster_admin(control_plane, hub_kubeconfig):
    r = control_plane.kubectl("get", "secrets", "-A", kubeconfig=hub_kubeconfig, check=False)
    assert r.returncode != 0 and "(Forbidden)" in r.stderr, r.stderr
    r = control_plane.kubectl("auth", "can-i", "create", "pods", "-n", "gpulab-anyone",
                              kubeconfig=hub_kubeconfig, check=False)
    assert r.stdout.strip() == "yes", r.stdout + r.stderr


def test_the_hub_writes_no_service_account_but_an_owned_namespaces_default(control_plane,
                                                                          hub_kubeconfig):
    """The hub applies each user namespace's default ServiceAccount (no token mounted), and
    nothing more: not one of another name (an old binding may still name it), not one that
    mounts its token, not in a namespace gpulab does not own."""
    cp, ns = control_plane, f"gpulab-sa{uuid.uuid4().hex[:6]}"

    def apply_as_hub(obj):
        return cp.kubectl("apply", "--server-side", "--field-manager=gpulab-hub", "-f", "-",
                          input=json.dumps(obj), kubeconfig=hub_kubeconfig, check=False)

    r = apply_as_hub({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {
        "app.kubernetes.io/managed-by": "gpulab", "gpulab.io/user": "sa",
        "pod-security.kubernetes.io/enforce": "baseline"}}})
    assert r.returncode == 0, r.stderr

    def account(name, namespace=ns, automount=False):
        return {"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": name, "namespace": namespace},
                "automountServiceAccountToken": automount}

    try:
        for refused in (account("prometheus"), account("default", automount=True),
                        account("default", namespace="kube-system")):
            r = apply_as_hub(refused)
            assert r.returncode != 0 and "(Forbidden)" in r.stderr, (refused, r.stdout)
        r = apply_as_hub(account("default"))
        assert r.returncode == 0, r.stderr
        assert get(cp, f"/api/v1/namespaces/{ns}/serviceaccounts/default")[
            "automountServiceAccountToken"] is False
        assert get(cp, f"/api/v1/namespaces/{ns}/serviceaccounts/prometheus") is None
    finally:
        cp.api("DELETE", f"/api/v1/namespaces/{ns}")


def form_text(form: str) -> str:
    """What a person reads on the spawn page: the form as JupyterHub renders it (it is a
    template to JupyterHub too), without tags."""
    rendered = jinja2.Environment().from_string(form).render()
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", rendered)).split())


async def test_spawn_form_shows_quota_and_holdings_of_now(make_spawner, ledger):
    _, led = ledger
    s = make_spawner()
    led.set_quota("user", s.user.name, Quota(max_gpus=3), actor="admin")
    form = await s.get_options_form()
    assert "Your GPU quota: 3 GPUs at once; 0 in use now." in form_text(form)
    # the profiles follow, each with what it would get; one over the quota is disabled
    assert 'value="h100-2"' in form and "2 H100" in form_text(form)
    assert re.search(r'id="profile-h100-9" value="h100-9"\s+disabled', form), form
    assert "9 H100 — 9 GPUs (NVIDIA-H100), 2 CPUs, 4G memory — unavailable: more than your " \
        "quota allows (3 at once)" in form_text(form)
    # what the user holds now (a job, and a server whose name looks like a template)
    job = led.admit(Request(user=s.user.name, kind="job", holder="digits", gpus=2))
    odd = led.admit(Request(user=s.user.name, kind="notebook", holder="x{{ 7*7 }}", gpus=1))
    try:
        text = form_text(await s.get_options_form())
        assert ("Your GPU quota: 3 GPUs at once; 3 in use now: job 'digits' (2), "
                "server 'x{{ 7*7 }}' (1).") in text, text
    finally:
        led.release(job.id)
        led.release(odd.id)


async def test_spawn_form_takes_one_known_profile(make_spawner):
    s = make_spawner()
    assert s.options_from_form({"profile": ["h100-2"], "_xsrf": ["x"]}) == {"profile": "h100-2"}
    # no profile: the default one, as KubeSpawner reads such a form
    assert s.options_from_form({"_xsrf": ["x"]}) == {}
    # the form is only read (KubeSpawner's contract); what it asks is refused at the start
    for bad in ({"profile": ["nope"]}, {"profile": ["cpu"], "privileged": ["1"]},
                {"profile": ["cpu", "h100-2"]}):
        with pytest.raises(SpawnRefused) as e:
            s.gpu_selection(s.options_from_form(bad))
        assert e.value.status_code == 400, bad


async def test_an_async_profile_list_is_resolved_at_start(control_plane, make_spawner, ledger):
    async def profiles(spawner):
        await asyncio.sleep(0)
        return [{"display_name": f"CPU for {spawner.user.name}", "slug": "mine"}]

    s = make_spawner(profile_list=profiles, storage_pvc_ensure=False)
    assert s.options_from_form({"profile": ["mine"]}) == {"profile": "mine"}
    s.user_options = {"profile": "mine"}
    await asyncio.wait_for(s.start(), 60)
    assert s.gpu_profile.display_name == f"CPU for {s.user.name}"
    s.user_options = {"profile": "yours"}
    await s.stop()
    s.clear_state()
    with pytest.raises(SpawnRefused) as e:
        await asyncio.wait_for(s.start(), 60)
    assert e.value.status_code == 400 and "There is no profile 'yours'" in e.value.jupyterhub_message


# -- KubeSpawner's profile_options: the same pod as a stock KubeSpawner's, plus GPUs ---------

OPTION_PROFILES = [
    {"display_name": "CPU only", "slug": "cpu"},
    {"display_name": "H100 with a choice of image", "slug": "h100", "default": True,
     "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"},
                              "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
                              "cpu_limit": 1, "mem_limit": "1G"},
     "profile_options": {
         "image": {"display_name": "Image", "choices": {
             "base": {"display_name": "base", "kubespawner_override": {
                 "image": "quay.io/jupyter/base-notebook:2025-01-01"}},
             "torch": {"display_name": "PyTorch", "default": True, "kubespawner_override": {
                 "image": "quay.io/jupyter/pytorch-notebook:cuda12-2025-01-01",
                 "environment": {"FRAMEWORK": "torch"}}}},
             "unlisted_choice": {"enabled": True, "display_name": "Other image",
                                 "validation_regex": "^quay\\.io/jupyter/.+:.+$",
                                 "kubespawner_override": {
                                     "image": "{value}",
                                     "extra_labels": {"gpulab-test/typed": "yes"}}}},
         "gpus": {"display_name": "GPUs", "choices": {
             "one": {"display_name": "1"},
             "four": {"display_name": "4", "kubespawner_override": {
                 "extra_resource_limits": {"nvidia.com/gpu": "4"},
                 "cpu_limit": 2}}}}}},
    {"display_name": "Free image", "slug": "free",
     "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"}},
     "profile_options": {"image": {"display_name": "Image", "unlisted_choice": {
         "enabled": True, "kubespawner_override": {"image": "{value}"}}}}},
]

OPTION_CASES = [
    ("default-profile", None, {}, 1),
    ("choices", {"profile": ["h100"], "profile-option-h100--image": ["base"],
                 "profile-option-h100--gpus": ["four"]},
     {"profile": "h100", "image": "base", "gpus": "four"}, 4),
    ("unlisted-with-regex",
     {"profile": ["h100"],
      "profile-option-h100--image--unlisted-choice": ["quay.io/jupyter/scipy-notebook:x"]},
     {"profile": "h100", "image--unlisted-choice": "quay.io/jupyter/scipy-notebook:x"}, 1),
    ("unlisted-without-regex",
     {"profile": ["free"], "profile-option-free--image--unlisted-choice": ["example.org/any:1"]},
     {"profile": "free", "image--unlisted-choice": "example.org/any:1"}, 1),
]


@pytest.mark.parametrize("case", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
@pytest.mark.parametrize("via", ["form", "api"])
async def test_profile_options_make_kubespawners_pod_plus_the_gpu_parts(
        control_plane, make_spawner, ledger, case, via):
    """A KubeGPUSpawner configured exactly like a KubeSpawner with profile_options: the pod
    the API server stores has the image, limits, labels and environment a stock KubeSpawner's
    `get_pod_manifest` gives for the same form or API options, plus gpulab's GPU parts."""
    from kubernetes_asyncio.client import ApiClient
    from kubespawner import KubeSpawner

    _, form, api, gpus = case
    cp = control_plane
    s = make_spawner(profile_list=OPTION_PROFILES, storage_pvc_ensure=False)
    stock_config = Config()
    stock_config.KubeSpawner.profile_list = OPTION_PROFILES
    stock = KubeSpawner(config=stock_config, _mock=True)
    for sp in (s, stock):
        if via == "form":
            sp.user_options = sp.options_from_form({**(form or {}), "_xsrf": ["x"]})
        else:
            sp.user_options = dict(api)
    assert s.user_options == stock.user_options
    await stock.load_user_options()
    want = ApiClient().sanitize_for_serialization(await stock.get_pod_manifest())
    await asyncio.wait_for(s.start(), 60)
    try:
        pod = get(cp, f"/api/v1/namespaces/{s.namespace}/pods/{s.pod_name}")
        (c,) = pod["spec"]["containers"]
        (w,) = want["spec"]["containers"]
        assert c["image"] == w["image"]
        # the same quantities (the API server writes them as strings), and the namespace's
        # default ephemeral storage (issue 36: KubeSpawner sets none)
        for resource, default in (("cpu", "2"), ("memory", "8Gi"), ("ephemeral-storage", "20Gi")):
            if resource not in w["resources"]["limits"]:
                assert c["resources"]["limits"].pop(resource) == default, resource
        assert ({k: float(v) for k, v in c["resources"]["limits"].items()}
                == {k: float(v) for k, v in w["resources"]["limits"].items()})
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
        env, wenv = ({e["name"]: e.get("value") for e in x["env"]} for x in (c, w))
        for name in ("FRAMEWORK", "CPU_LIMIT", "MEM_LIMIT"):
            assert env.get(name) == wenv.get(name), name
        typed = want["metadata"]["labels"].get("gpulab-test/typed")
        assert pod["metadata"]["labels"].get("gpulab-test/typed") == typed
        assert pod["spec"].get("nodeSelector") == want["spec"].get("nodeSelector")
        # gpulab's parts: the GPU toleration, the ledger's allocation of the final count
        assert GPU_TOLERATION in pod["spec"]["tolerations"]
        (alloc,) = s.gpu_ledger.open_allocations(user=s.user.name)
        assert alloc.gpus == gpus
    finally:
        await s.stop()
        s.clear_state()


async def test_profiles_of_other_groups_are_not_offered_nor_started(make_spawner):
    profiles = [{"display_name": "CPU only", "slug": "cpu"},
                {"display_name": "2 H100 (ml)", "slug": "ml", "allowed_groups": ["ml"],
                 "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "2"}}}]
    s = make_spawner(profile_list=profiles)
    form = await s.get_options_form()
    assert 'value="cpu"' in form and 'value="ml"' not in form and "2 H100" not in form
    s.user_options = {"profile": "ml"}
    with pytest.raises(SpawnRefused) as e:
        await s.start()
    assert e.value.status_code == 400
    assert "There is no profile 'ml'. Choose one of: cpu." in e.value.jupyterhub_message
    s.user.groups = [SimpleNamespace(name="ml")]
    assert 'value="ml"' in await s.get_options_form()
