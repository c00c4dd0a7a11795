"""The Kubernetes objects of KubeGPUSpawner, compared with literal dicts."""

import copy
import re

import pytest

from gpulab.hub.cluster.namespaces import effective_max_gpus
from gpulab.hub.jobs.kubeobjects import make_job_network_policy
from gpulab.hub.cluster.kubeobjects import (
    escape_expansion,
    explain_unschedulable,
    free_gpus_by_node,
    make_gpu_quota,
    make_user_namespace,
    make_user_network_policies,
    parse_quota_refusal,
    server_pod_settings,
)
from tests.cluster.kubelet import expand
from tests.cluster.netpol import Endpoint, allowed


def test_user_namespace_enforces_pod_security_baseline():
    assert make_user_namespace(name="gpulab-ann", user_label="ann") == {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": "gpulab-ann",
            "labels": {
                "app.kubernetes.io/managed-by": "gpulab",
                "gpulab.io/user": "ann",
                "pod-security.kubernetes.io/enforce": "baseline",
                "pod-security.kubernetes.io/enforce-version": "latest",
            },
        },
    }


def test_user_namespace_refuses_an_unknown_level():
    with pytest.raises(ValueError, match="pod_security must be one of"):
        make_user_namespace(name="n", user_label="ann", pod_security="lax")


def test_gpu_quota():
    assert make_gpu_quota(namespace="gpulab-ann", max_gpus=2, user_label="ann") == {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {
            "name": "gpulab-gpus",
            "namespace": "gpulab-ann",
            "labels": {"app.kubernetes.io/managed-by": "gpulab", "gpulab.io/user": "ann"},
        },
        "spec": {"hard": {"requests.nvidia.com/gpu": "2"}},
    }


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True], ids=["negative", "float", "str", "bool"])
def test_gpu_quota_needs_a_whole_number(bad):
    with pytest.raises(ValueError):
        make_gpu_quota(namespace="n", max_gpus=bad, user_label="ann")


SHARED = {"nfs": {"server": "nfs.example.org", "path": "/gpulab"}}


def settings(**kw):
    args = dict(gpus=2, tolerations=[], volumes=[], volume_mounts=[], environment={"A": "1"},
                home={"claim": "claim-ann", "mount": "/home/jovyan"}, shared_volume=SHARED,
                shared_mount="/gpulab/shared", user_subpath="users/ann", datasets_subpath="datasets")
    args.update(kw)
    return server_pod_settings(**args)


def test_server_settings_with_gpus_home_and_shared_storage():
    assert settings() == {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [
            {"name": "home", "persistentVolumeClaim": {"claimName": "claim-ann"}},
            {"name": "gpulab-shared", "nfs": {"server": "nfs.example.org", "path": "/gpulab"}},
        ],
        "volume_mounts": [
            {"name": "home", "mountPath": "/home/jovyan"},
            {"name": "gpulab-shared", "mountPath": "/gpulab/shared/users/ann", "subPath": "users/ann"},
            {"name": "gpulab-shared", "mountPath": "/gpulab/shared/datasets", "subPath": "datasets",
             "readOnly": True},
        ],
        "environment": {
            "A": "1",
            "GPULAB_SHARED_DIR": "/gpulab/shared",
            "GPULAB_USER_DIR": "/gpulab/shared/users/ann",
            "GPULAB_DATASETS_DIR": "/gpulab/shared/datasets",
        },
    }


@pytest.mark.parametrize("no_storage", [None, {}], ids=["none", "empty-the-traits-default"])
def test_server_settings_without_gpus_or_storage_keep_the_configured_values(no_storage):
    configured_tolerations = [{"key": "x", "operator": "Exists"}]
    out = settings(gpus=0, tolerations=configured_tolerations, home=None,
                   shared_volume=no_storage)
    assert out == {
        "tolerations": [{"key": "x", "operator": "Exists"}],
        "volumes": [],
        "volume_mounts": [],
        "environment": {"A": "1"},
    }
    assert out["tolerations"] is not configured_tolerations  # a copy: the config stays as it was


def test_server_settings_extend_dict_shaped_traits():
    out = settings(tolerations={"a": {"key": "a"}}, volumes={"v": {"name": "v"}},
                   volume_mounts={"v": {"name": "v", "mountPath": "/v"}}, home=None,
                   datasets_subpath=None)
    assert out["tolerations"] == {
        "a": {"key": "a"},
        "gpulab-gpu": {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    }
    assert out["volumes"] == {"v": {"name": "v"}, "gpulab-shared": {"name": "gpulab-shared", **SHARED}}
    assert out["volume_mounts"] == {
        "v": {"name": "v", "mountPath": "/v"},
        "gpulab-shared-user": {"name": "gpulab-shared", "mountPath": "/gpulab/shared/users/ann",
                               "subPath": "users/ann"},
    }
    assert "GPULAB_DATASETS_DIR" not in out["environment"]


@pytest.mark.parametrize("subpath", ["", "/users/ann", "users/../bob", ".."],
                         ids=["empty", "absolute", "escapes", "parent"])
def test_server_settings_refuse_a_sub_path_outside_the_share(subpath):
    with pytest.raises(ValueError, match="user_subpath"):
        settings(user_subpath=subpath)


def node(name, gpus, model="NVIDIA-H100", unschedulable=False):
    n = {"metadata": {"name": name, "labels": {"nvidia.com/gpu.product": model} if gpus else {}},
         "spec": {"unschedulable": True} if unschedulable else {},
         "status": {"allocatable": {"nvidia.com/gpu": str(gpus)} if gpus else {"cpu": "8"}}}
    return n


def pod(node_name, gpus, phase="Running", where="limits"):
    return {"spec": {"nodeName": node_name,
                     "containers": [{"resources": {where: {"nvidia.com/gpu": str(gpus)}}},
                                    {"resources": {}}]},
            "status": {"phase": phase}}


def test_free_gpus_by_node():
    nodes = [node("h0", 8), node("h1", 8), node("a0", 4, "NVIDIA-A10"), node("cpu", 0),
             node("h2", 8, unschedulable=True)]
    pods = [pod("h0", 6), pod("h0", 1, where="requests"), pod("h1", 8, phase="Succeeded"),
            pod("a0", 4), pod("cpu", 0), pod("elsewhere", 3)]
    assert free_gpus_by_node(nodes=nodes, pods=pods) == {"h0": 1, "h1": 8, "a0": 0}
    assert free_gpus_by_node(nodes=nodes, pods=pods, model="NVIDIA-H100") == {"h0": 1, "h1": 8}
    assert free_gpus_by_node(nodes=nodes, pods=pods, model="NVIDIA-B200") == {}


INSUFFICIENT = ("0/5 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
                "1 node(s) had untolerated taint {x: y}, 3 Insufficient nvidia.com/gpu. "
                "preemption: 0/5 nodes are available: 5 No preemption victims found.")


@pytest.mark.parametrize(
    "message, gpus, model, free, expected",
    [
        (INSUFFICIENT, 4, "NVIDIA-H100", {"h0": 2, "h1": 0},
         "No node has 4 free GPUs of model NVIDIA-H100 (most free on one node: 2); waiting."),
        (INSUFFICIENT, 9, None, {"h0": 8}, "No node has 9 free GPUs (most free on one node: 8); waiting."),
        ("0/5 nodes are available: 5 node(s) didn't match Pod's node affinity/selector.", 1,
         "NVIDIA-B200", {},
         "No node has GPUs of model NVIDIA-B200; waiting (ask an admin which GPU models the "
         "cluster has)."),
        ('0/5 nodes are available: persistentvolumeclaim "claim-ann" not found.', 1, None, {"h0": 8},
         "The storage volume 'claim-ann' of this server does not exist; waiting for it."),
        ("0/5 nodes are available: pod has unbound immediate PersistentVolumeClaims.", 0, None, {},
         "A storage volume of this server is not ready yet (not bound to a disk); waiting."),
        ("0/5 nodes are available: 5 Insufficient cpu.", 0, None, {}, None),
    ],
    ids=["gpus-busy", "too-many", "no-such-model", "missing-pvc", "unbound-pvc", "other"],
)
def test_explain_unschedulable(message, gpus, model, free, expected):
    assert explain_unschedulable(message, gpus=gpus, model=model, free_by_node=free) == expected


def test_parse_quota_refusal():
    message = ('pods "jupyter-ann" is forbidden: exceeded quota: gpulab-gpus, requested: '
               "requests.nvidia.com/gpu=2, used: requests.nvidia.com/gpu=1, limited: "
               "requests.nvidia.com/gpu=2")
    assert parse_quota_refusal(message) == {"requested": 2, "used": 1, "limited": 2}
    assert parse_quota_refusal("exceeded quota: q, requested: pods=1, used: pods=1, limited: pods=1") is None
    assert parse_quota_refusal('pods "x" is forbidden: violates PodSecurity') is None


ROWS = [
    {"scope": "default", "name": "", "max_gpus": 1},
    {"scope": "group", "name": "vision", "max_gpus": 4, "gpu_hours": 10.0, "window_hours": 24},
    {"scope": "group", "name": "nlp", "max_gpus": 2},
    {"scope": "user", "name": "carl", "max_gpus": 0},
]


@pytest.mark.parametrize(
    "rows, user, groups, expected",
    [
        (ROWS, "ann", (), 1),
        (ROWS, "ann", ("nlp", "vision"), 4),
        (ROWS, "carl", ("vision",), 0),
        ([], "ann", ("nlp",), None),
    ],
    ids=["default", "most-generous-group", "user-wins", "none"],
)
def test_effective_max_gpus(rows, user, groups, expected):
    assert effective_max_gpus(rows, user, groups) == expected


# -- NetworkPolicies of a user namespace

MANAGED = {"app.kubernetes.io/managed-by": "gpulab", "gpulab.io/user": "ann"}
HUB_NS = {"matchLabels": {"kubernetes.io/metadata.name": "gpulab"}}


def test_user_network_policies_literal():
    assert make_user_network_policies(namespace="gpulab-ann", user_label="ann",
                                      hub_namespace="gpulab") == [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "gpulab-user-pods", "namespace": "gpulab-ann", "labels": MANAGED},
            "spec": {
                "podSelector": {},
                "policyTypes": ["Ingress", "Egress"],
                "egress": [
                    {"to": [{"namespaceSelector": {"matchLabels": {
                                 "kubernetes.io/metadata.name": "kube-system"}},
                             "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
                     "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
                    {"to": [{"namespaceSelector": HUB_NS,
                             "podSelector": {"matchLabels": {"component": "hub"}}}],
                     "ports": [{"protocol": "TCP", "port": 8081}, {"protocol": "TCP", "port": 8002}]},
                ],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "gpulab-servers", "namespace": "gpulab-ann", "labels": MANAGED},
            "spec": {
                "podSelector": {"matchLabels": {"component": "singleuser-server"}},
                "policyTypes": ["Ingress"],
                "ingress": [{
                    "from": [{"namespaceSelector": HUB_NS, "podSelector": {"matchExpressions": [
                        {"key": "component", "operator": "In", "values": ["hub", "proxy"]}]}}],
                    "ports": [{"protocol": "TCP", "port": 8888}],
                }],
            },
        },
    ]


def test_allowed_egress_is_added_to_every_user_pod():
    nfs = {"to": [{"ipBlock": {"cidr": "10.0.0.5/32"}}], "ports": [{"protocol": "TCP", "port": 2049}]}
    pods, servers = make_user_network_policies(namespace="n", user_label="ann", hub_namespace="hub",
                                               server_port=9999, server_component="nb",
                                               allowed_egress=[nfs])
    assert pods["spec"]["egress"][2:] == [nfs]
    assert servers["spec"]["podSelector"] == {"matchLabels": {"component": "nb"}}
    assert servers["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9999}]


@pytest.mark.parametrize("bad", [{}, {"from": []}, {"to": [], "podSelector": {}}],
                         ids=["empty", "ingress-rule", "extra-key"])
def test_allowed_egress_takes_egress_rules_only(bad):
    with pytest.raises(ValueError, match="allowed_egress"):
        make_user_network_policies(namespace="n", user_label="ann", hub_namespace="hub",
                                   allowed_egress=[bad])


def test_allowed_server_ingress_is_added_to_the_servers_only():
    """A hub and proxy outside the cluster (an operator's ``allowed_server_ingress``) reach
    the servers; the rule goes to the servers' policy, nowhere else."""
    proxy = {"from": [{"ipBlock": {"cidr": "10.1.2.3/32"}}], "ports": [{"protocol": "TCP", "port": 8888}]}
    pods, servers = make_user_network_policies(namespace="n", user_label="ann", hub_namespace="hub",
                                               allowed_server_ingress=[proxy])
    assert servers["spec"]["ingress"][1:] == [proxy]
    assert "ingress" not in pods["spec"] and len(pods["spec"]["egress"]) == 2


@pytest.mark.parametrize("bad", [{}, {"to": []}, {"from": [], "podSelector": {}}, {"from": {"ipBlock": {}}},
                                 "10.0.0.1/32"],
                         ids=["empty", "egress-rule", "extra-key", "not-a-list", "not-a-rule"])
def test_allowed_server_ingress_takes_ingress_rules_only(bad):
    with pytest.raises(ValueError, match="allowed_server_ingress"):
        make_user_network_policies(namespace="n", user_label="ann", hub_namespace="hub",
                                   allowed_server_ingress=[bad])


INTERNET = {"to": [{"ipBlock": {"cidr": "0.0.0.0/0",
                                "except": ["169.254.169.254/32", "10.0.0.0/8"]}}]}
HUB = Endpoint.pod("gpulab", component="hub")
PROXY = Endpoint.pod("gpulab", component="proxy")
SCHEDULER = Endpoint.pod("gpulab", component="user-scheduler")
DNS = Endpoint.pod("kube-system", **{"k8s-app": "kube-dns"})
METADATA = Endpoint.address("169.254.169.254")
USER_NS = {"app.kubernetes.io/managed-by": "gpulab"}


def server(user):
    return Endpoint.pod(f"gpulab-{user}", USER_NS, component="singleuser-server",
                        **{"gpulab.io/user": user})


def replica(user, job, role="worker"):
    return Endpoint.pod(f"gpulab-{user}", USER_NS, **{
        "app.kubernetes.io/managed-by": "gpulab", "app.kubernetes.io/component": "training-job",
        "gpulab.io/user": user, "gpulab.io/job": job, "gpulab.io/role": role})


@pytest.fixture(scope="module")
def policies():
    out = []
    for user, egress in (("vic", [INTERNET]), ("eve", [])):
        out += make_user_network_policies(namespace=f"gpulab-{user}", user_label=user,
                                           hub_namespace="gpulab", allowed_egress=egress)
        for job in ("a", "b"):
            out.append(make_job_network_policy(job=job, namespace=f"gpulab-{user}",
                                               user_label=user))
    return out


@pytest.mark.parametrize("src, dst, port, protocol, ok", [
    (PROXY, server("vic"), 8888, "TCP", True),
    (HUB, server("vic"), 8888, "TCP", True),
    (PROXY, server("vic"), 2222, "TCP", False),
    (SCHEDULER, server("vic"), 8888, "TCP", False),
    (server("eve"), server("vic"), 8888, "TCP", False),
    (replica("eve", "a"), server("vic"), 8888, "TCP", False),
    (server("eve"), replica("vic", "a"), 2222, "TCP", False),
    (replica("eve", "a"), replica("vic", "a"), 2222, "TCP", False),
    (HUB, replica("vic", "a"), 2222, "TCP", False),
    (server("vic"), replica("vic", "a"), 2222, "TCP", False),
    (replica("vic", "b"), replica("vic", "a"), 2222, "TCP", False),
    (replica("vic", "a", "chief"), replica("vic", "a"), 2222, "TCP", True),
    (replica("vic", "a"), replica("vic", "a", "ps"), 40000, "TCP", True),  # NCCL, any port
    (server("vic"), HUB, 8081, "TCP", True),
    (server("vic"), HUB, 8002, "TCP", True),
    (replica("vic", "a"), HUB, 8081, "TCP", True),
    (server("vic"), PROXY, 8001, "TCP", False),  # the proxy's API
    (server("vic"), SCHEDULER, 10251, "TCP", False),
    (server("vic"), DNS, 53, "UDP", True),
    (replica("eve", "a"), DNS, 53, "TCP", True),
    (server("eve"), Endpoint.address("1.1.1.1"), 443, "TCP", False),
    (server("vic"), Endpoint.address("1.1.1.1"), 443, "TCP", True),  # vic's operator allows it
    (server("vic"), METADATA, 80, "TCP", False),
    (replica("vic", "a"), METADATA, 80, "TCP", False),
    (server("eve"), METADATA, 80, "TCP", False),
], ids=lambda x: None if not isinstance(x, Endpoint) else (
    x.ip or f"{x.namespace}:{x.labels.get('component') or x.labels.get('k8s-app') or x.labels.get('gpulab.io/role')}"
    f"{':' + x.labels['gpulab.io/job'] if 'gpulab.io/job' in x.labels else ''}"))
def test_who_reaches_whom(policies, src, dst, port, protocol, ok):
    assert allowed(policies, src, dst, port, protocol) is ok


# -- the kubelet's $(VAR) expansion


@pytest.mark.parametrize("text", [
    "plain", "$(HOME)", "$$(HOME)", "$$$(HOME)", "a$(SECRET)b", "$", "$$", "x$", "$(", "$(HOME",
    "cost $5", "$()", "ünï$(HOME)çødé",
])
def test_escaped_text_reaches_the_process_as_written(text):
    env = {"HOME": "/root", "SECRET": "s3cret"}
    assert expand(escape_expansion(text), env) == text
    assert "s3cret" not in expand(escape_expansion(text), env)


def test_escape_expansion_literal():
    assert escape_expansion("a$(B)$$c$") == "a$$(B)$$$$c$$"
    # the old way (only "$(" doubled) is not enough: "$$(HOME)" reached the process expanded
    assert expand("$$(HOME)".replace("$(", "$$("), {"HOME": "/root"}) == "$/root"


def test_container_defaults():
    """Issue 36: the operator's default CPU, memory and ephemeral storage, checked; a
    resource with a default limit and no default request reserves its limit (as a
    LimitRange's ``defaultRequest`` did)."""
    from gpulab.hub.cluster.kubeobjects import container_defaults

    assert container_defaults(limits={"cpu": 2, "memory": "8Gi", "ephemeral-storage": "20Gi"},
                              requests={"cpu": "100m", "memory": "512Mi"}) == (
        {"cpu": "2", "memory": "8Gi", "ephemeral-storage": "20Gi"},
        {"cpu": "100m", "memory": "512Mi", "ephemeral-storage": "20Gi"})
    assert container_defaults(limits={}, requests={}) == ({}, {})
    assert container_defaults(limits={}, requests={"cpu": "1"}) == ({}, {"cpu": "1"})


@pytest.mark.parametrize("limits, requests, message", [
    ({"gpu": "1"}, {}, "'gpu' is not one of cpu, memory, ephemeral-storage"),
    ({"memory": "8 GB"}, {}, "memory '8 GB' is not a quantity"),
    ({"cpu": True}, {}, "cpu True is not a quantity"),
    ({"memory": "1Gi"}, {"memory": "2G"}, "memory 2G is above default_container_limits' 1Gi"),
    ({"cpu": "500m"}, {"cpu": "1"}, "cpu 1 is above"),
], ids=["resource", "unit", "bool", "request-above-limit", "millicores"])
def test_container_defaults_refuses_bad_ones(limits, requests, message):
    from gpulab.hub.cluster.kubeobjects import container_defaults

    with pytest.raises(ValueError, match=re.escape(message)):
        container_defaults(limits=limits, requests=requests)


LIMITS = {"cpu": "2", "memory": "8Gi", "ephemeral-storage": "20Gi"}
REQUESTS = {"cpu": "100m", "memory": "512Mi", "ephemeral-storage": "1Gi"}


@pytest.mark.parametrize("own, want", [
    # nothing of its own: the defaults (what the LimitRange gave at admission)
    (None, {"limits": LIMITS, "requests": REQUESTS}),
    ({}, {"limits": LIMITS, "requests": REQUESTS}),
    # a limit of its own and no request: the API server makes the request that limit, so
    # no default request is added; the other resources get theirs
    ({"limits": {"cpu": "4", "nvidia.com/gpu": "1"}},
     {"limits": {**LIMITS, "cpu": "4", "nvidia.com/gpu": "1"},
      "requests": {"memory": "512Mi", "ephemeral-storage": "1Gi"}}),
    # a request of its own (KubeSpawner writes numbers) below the default limit: kept, with
    # the default limit
    ({"requests": {"cpu": 0.5, "memory": 16000000}},
     {"limits": LIMITS, "requests": {"cpu": 0.5, "memory": 16000000, "ephemeral-storage": "1Gi"}}),
    # both of its own: untouched; other keys (claims) kept
    ({"limits": {"cpu": "1", "memory": "1G", "ephemeral-storage": "2Gi"},
      "requests": {"cpu": "1", "memory": "1G", "ephemeral-storage": "2Gi"}, "claims": []},
     {"limits": {"cpu": "1", "memory": "1G", "ephemeral-storage": "2Gi"},
      "requests": {"cpu": "1", "memory": "1G", "ephemeral-storage": "2Gi"}, "claims": []}),
], ids=["none", "empty", "own-limit", "own-request-below", "all-own"])
def test_with_container_defaults(own, want):
    from gpulab.hub.cluster.kubeobjects import with_container_defaults

    before = copy.deepcopy(own)
    got = with_container_defaults(own, limits=LIMITS, requests=REQUESTS)
    assert got == want
    assert own == before  # a new dict: the caller's untouched
    # applied twice (each create try sends the same pod): the same
    assert with_container_defaults(got, limits=LIMITS, requests=REQUESTS) == want


@pytest.mark.parametrize("own, message", [
    ({"requests": {"cpu": 8}}, "a cpu request of 8 with no cpu limit of its own, above the "
                               "default cpu limit 2"),
    ({"requests": {"memory": 17179869184}, "limits": {"cpu": "4"}}, "a memory request of "
     "17179869184 with no memory limit of its own, above the default memory limit 8Gi"),
], ids=["cpu", "memory-bytes"])
def test_a_request_above_the_default_limit_without_a_limit_is_refused(own, message):
    """As the LimitRange made the API server refuse such a pod: the request is not taken as
    the limit (a profile option's choice of requests would reserve without bound)."""
    from gpulab.hub.cluster.kubeobjects import ContainerDefaultsError, with_container_defaults

    with pytest.raises(ContainerDefaultsError, match=re.escape(message)):
        with_container_defaults(own, limits=LIMITS, requests=REQUESTS)
    # with a limit of its own, any request up to it is the container's business
    own = {**own, "limits": {**own.get("limits", {}), **{r: "64" if r == "cpu" else "64Gi"
                                                           for r in own["requests"]}}}
    assert with_container_defaults(own, limits=LIMITS, requests=REQUESTS)["requests"] == {
        **own["requests"], **{r: v for r, v in REQUESTS.items() if r not in own["limits"]}}


def test_with_container_defaults_none_configured():
    from gpulab.hub.cluster.kubeobjects import with_container_defaults

    assert with_container_defaults({"limits": {}, "requests": {}}, limits={}, requests={}) == {}
    assert with_container_defaults({"limits": {"cpu": "1"}}, limits={}, requests={}) == {
        "limits": {"cpu": "1"}}


def test_quantities_compare_across_units():
    from gpulab.hub.cluster.kubeobjects import quantity

    assert quantity("1Gi") > quantity("1G") > quantity("950Mi")
    assert quantity("500m") == quantity("0.5") < quantity("1")
