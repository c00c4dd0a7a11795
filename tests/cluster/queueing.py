"""Kueue v0.17.0 and JobSet v0.11.1 on the test control plane: ``ControlPlane(queueing=True)``.

What ``start_queueing`` adds to a started control plane (see ``ControlPlane``'s docstring):

1. The CRDs of both, from the manifests build.sh copies out of their Go modules
   (``bin/kueue-manifests`` and ``bin/jobset-manifests``: each module's
   ``config/components/{crd,webhook,rbac}``). The conversion webhooks their kustomizations enable
   (Kueue serves v1beta1 and v1beta2 of most kinds) point at the controller on loopback.
2. Each controller's own ClusterRole and Roles (``config/components/rbac/role.yaml``,
   ``manager_secrets_role.yaml``, ...; renamed ``kueue-manager-role`` etc.) bound to its ServiceAccount
   (``kueue-system/kueue-controller-manager``, ``jobset-system/jobset-controller-manager``).
   The controllers run outside the cluster, so they authenticate with a client certificate whose
   subject is that ServiceAccount's user name and groups: the API server's RBAC sees the very
   identity the in-cluster Deployment would have, and nothing more.
3. Both controllers as processes (logs ``logs/kueue.log``, ``logs/jobset.log``), leader
   election, metrics and internal certificate management off, their webhook servers on
   127.0.0.1 free ports with a serving certificate from the control plane's CA.
4. The Mutating/ValidatingWebhookConfigurations of their modules, with the patches of their
   kustomizations (Kueue: pods and Deployments in kube-system and kueue-system are exempt;
   JobSet: its pod webhooks only see JobSet pods), named ``kueue-...`` / ``jobset-...`` as the
   release manifests name them, and ``clientConfig.url: https://127.0.0.1:<port><path>`` with
   the CA bundle. Kueue's manifest lists a webhook for every framework it knows; Kueue v0.17.0
   answers those of frameworks not enabled with no-op handlers. Each path is still probed once
   and only those the binary serves are kept, so that a manifest path it answered 404 for
   could never fail every create of that kind.

Kueue's Configuration (``kueue_configuration``): frameworks ``batch/job``,
``jobset.x-k8s.io/jobset`` and ``pod``; ``managedJobsNamespaceSelector`` exempts kube-system,
kueue-system and jobset-system (the pod integration needs one); fair sharing on; waitForPodsReady
on (timeout 5 minutes, no blocking admission); its visibility API server (VisibilityOnDemand:
where pending work stands in its queues) on loopback, registered with the API server's
aggregation layer as Kueue's manifests register it (``config/components/visibility``: an
APIService skipping TLS verification, the delegated authentication's RBAC), through a Service
of type ExternalName ``localhost`` instead of the controller's pod (``visibility_objects``). Its
serving certificate, Kueue's fixed ``/visibility/tls.{crt,key}``, is made like the metrics
one below.

Readiness: both ``/readyz`` answer 200 (Kueue's includes its webhook server), and server-side
dry-run creates of a ResourceFlavor (Kueue's webhooks), a JobSet and a pod in a LocalQueue pass
and come back mutated by JobSet's webhook (network defaulted) and Kueue's (JobSet suspended, pod
gated): the API server calls the webhooks through their configurations. A dry run that merely
passes is not enough: the API server reads new webhook configurations a moment after they are
applied, and a JobSet made before then lacks JobSet's defaults (its controller panics on it).
"""

from __future__ import annotations

import copy
import functools
import http.client
import json
import os
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from .controlplane import ControlPlane

QUEUEING_BINARIES = ("kueue", "jobset")
QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_FRAMEWORKS = ("batch/job", "jobset.x-k8s.io/jobset", "pod")
# namespaces whose Jobs and pods Kueue never manages (its pod webhook's selector excludes the
# first two as the release manifests do)
UNMANAGED_NAMESPACES = ("kube-system", "kueue-system", "jobset-system")

# name, namespace of its ServiceAccount, manifests folder under bin/
CONTROLLERS = {
    "kueue": ("kueue-system", "kueue-controller-manager", "kueue-manifests"),
    "jobset": ("jobset-system", "jobset-controller-manager", "jobset-manifests"),
}
# Kueue registers every webhook handler (no-op ones for integrations it does not run) before
# its manager starts serving; JobSet registers its own in a goroutine once its manager runs,
# after its controllers' caches sync (main.go setupControllers), and serves all of them
REGISTERS_WEBHOOKS_LATE = frozenset({"jobset"})


#: Kueue's client to the API server (``clientConnection``): its release manifests' 50 requests/s
#: (burst 100) made each gated notebook pod wait seconds for its admission in a storm of 500
#: first spawns (bench/scale_kube.py: p99 6.5-9.5x stock KubeSpawner's, gpulab's own part
#: 0.3-0.9 s at p50); every admission is several writes (the Workload, its quota reservation,
#: the pod's gate, the queues' status). docs/deploy-kubernetes.md, section 9, says the same
KUEUE_CLIENT_CONNECTION = {"qps": 500, "burst": 1000}
#: reconcilers at once per kind: Kueue's release manifests' (controller-runtime's default is 1
#: where the configuration names none), but 20 Pod and Workload reconcilers instead of 5
#: (bench/scale_kube.py, 500 first spawns: Kueue's pod reconciler made each Workload p99 3 s
#: after its pod and lifted its gate p99 4 s after admission with 5; 1 s and 2 s with 20,
#: p99 spawn 12.1 s to 8.4 s). docs/deploy-kubernetes.md, section 9
KUEUE_GROUP_KIND_CONCURRENCY = {
    "Job.batch": 5, "Pod": 20, "Workload.kueue.x-k8s.io": 20, "LocalQueue.kueue.x-k8s.io": 1,
    "Cohort.kueue.x-k8s.io": 1, "ClusterQueue.kueue.x-k8s.io": 1, "ResourceFlavor.kueue.x-k8s.io": 1}


# --------------------------------------------------------------------------- pure builders


def kueue_configuration(*, webhook_port: int, health_port: int, cert_dir: str,
                        visibility_port: int = 8082) -> dict[str, Any]:
    """Kueue's ``config.kueue.x-k8s.io/v1beta2`` Configuration for a controller on loopback."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},  # "0": no metrics server
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": cert_dir},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "clientConnection": dict(KUEUE_CLIENT_CONNECTION),
        "controller": {"groupKindConcurrency": dict(KUEUE_GROUP_KIND_CONCURRENCY)},
        "managedJobsNamespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": list(UNMANAGED_NAMESPACES)}
            ]
        },
        # v1beta2 has no `enable` fields: the presence of these sections turns them on
        "waitForPodsReady": {"timeout": "5m", "blockAdmission": False},
        "fairSharing": {"preemptionStrategies": ["LessThanOrEqualToFinalShare", "LessThanInitialShare"]},
        "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
        # the visibility API server (VisibilityOnDemand, on by default), on loopback
        "visibilityServer": {"bindAddress": "127.0.0.1", "bindPort": visibility_port},
    }


def jobset_configuration(*, webhook_port: int, health_port: int, cert_dir: str) -> dict[str, Any]:
    """JobSet's ``config.jobset.x-k8s.io/v1alpha1`` Configuration for a controller on loopback."""
    return {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": cert_dir},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
    }


def _set_pointer(doc: Any, pointer: str, value: Any) -> None:
    """Set a JSON pointer (``/webhooks/1``) in ``doc`` (JSON 6902 ``add``/``replace``)."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.lstrip("/").split("/")]
    for p in parts[:-1]:
        doc = doc[int(p)] if isinstance(doc, list) else doc[p]
    last = parts[-1]
    if isinstance(doc, list):
        doc[int(last)] = value
    else:
        doc[last] = value


def kustomize_webhooks(folder: Path) -> list[dict[str, Any]]:
    """The webhook configurations of a module's ``config/components/webhook`` with the patches
    of its kustomization.yaml applied: inline patches that merge webhooks by name (Kueue's) and
    JSON 6902 patch files with a target (JobSet's). Only what these two use is understood;
    anything else raises ``ValueError``."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs = [d for d in yaml.safe_load_all((folder / "manifests.yaml").read_text()) if d]
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for patch in kustomization.get("patches", []):
        if "patch" in patch:
            p = yaml.safe_load(patch["patch"])
            target = by_name[(p["kind"], p["metadata"]["name"])]
            hooks = {w["name"]: w for w in target["webhooks"]}
            for w in p.get("webhooks", []):
                hooks[w["name"]].update(copy.deepcopy({k: v for k, v in w.items() if k != "name"}))
        elif "path" in patch and "target" in patch:
            t = patch["target"]
            target = by_name[(t["kind"], t["name"])]
            for op in yaml.safe_load((folder / patch["path"]).read_text()):
                if op["op"] not in ("add", "replace"):
                    raise ValueError(f"unsupported patch op {op['op']} in {patch['path']}")
                _set_pointer(target, op["path"], copy.deepcopy(op["value"]))
        else:
            raise ValueError(f"unsupported kustomization patch in {folder}: {patch}")
    return docs


def loopback_webhooks(
    docs: list[dict[str, Any]], *, prefix: str, port: int, ca_pem: bytes, keep_path: Any = None
) -> list[dict[str, Any]]:
    """Webhook configurations renamed ``<prefix>-<name>`` whose webhooks call
    ``https://127.0.0.1:<port><path>`` with ``ca_pem`` as CA bundle; ``keep_path(path)`` (if
    given) decides which webhooks stay."""
    import base64

    bundle = base64.b64encode(ca_pem).decode()
    out = []
    for d in docs:
        d = copy.deepcopy(d)
        d["metadata"] = {"name": f"{prefix}-{d['metadata']['name']}"}
        hooks = []
        for w in d["webhooks"]:
            path = w["clientConfig"]["service"]["path"]
            if keep_path is not None and not keep_path(path):
                continue
            w["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle}
            hooks.append(w)
        d["webhooks"] = hooks
        if hooks:
            out.append(d)
    return out


def kustomize_crds(folder: Path, *, port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """The CRDs of a module's ``config/components/crd`` (its kustomization's resources) with the
    conversion webhooks its patches enable pointing at ``https://127.0.0.1:<port>/convert``."""
    import base64

    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    crds = {}
    for res in kustomization["resources"]:
        for d in yaml.safe_load_all((folder / res).read_text()):
            if d:
                crds[d["metadata"]["name"]] = d
    bundle = base64.b64encode(ca_pem).decode()
    for patch in kustomization.get("patches", []):
        path = patch.get("path", "")
        if not Path(path).name.startswith("webhook_in_"):
            continue  # the cert-manager CA injection patches: the CA bundle is set here
        p = yaml.safe_load((folder / path).read_text())
        webhook = p["spec"]["conversion"]["webhook"]
        crds[p["metadata"]["name"]]["spec"]["conversion"] = {
            "strategy": "Webhook",
            "webhook": {
                "conversionReviewVersions": webhook["conversionReviewVersions"],
                "clientConfig": {
                    "url": f"https://127.0.0.1:{port}{webhook['clientConfig']['service']['path']}",
                    "caBundle": bundle,
                },
            },
        }
    return list(crds.values())


MANAGER_RBAC_FILES = ("role.yaml", "role_binding.yaml", "manager_secrets_role.yaml",
                     "manager_secrets_role_binding.yaml", "manager_clusterprofiles_role.yaml",
                     "manager_clusterprofiles_role_binding.yaml")


def manager_rbac(folder: Path, *, name: str, namespace: str, service_account: str) -> list[dict[str, Any]]:
    """The controller's own Roles and ClusterRoles with their bindings (``MANAGER_RBAC_FILES``
    that its ``rbac/`` has; not leader election, metrics or the editor/viewer roles for people),
    made as the release manifests make them: names prefixed ``<name>-``, namespace ``system``
    replaced by ``namespace``, subject ServiceAccount ``system/controller-manager`` replaced by
    ``namespace/service_account``. With that namespace and ServiceAccount first."""
    out: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": service_account, "namespace": namespace}},
    ]
    for file in MANAGER_RBAC_FILES:
        if not (folder / file).is_file():
            continue
        for d in yaml.safe_load_all((folder / file).read_text()):
            if not d:
                continue
            d = copy.deepcopy(d)
            meta = {"name": f"{name}-{d['metadata']['name']}"}
            if d["kind"] in ("Role", "RoleBinding"):
                meta["namespace"] = namespace
            d["metadata"] = meta
            if "roleRef" in d:
                d["roleRef"]["name"] = f"{name}-{d['roleRef']['name']}"
                d["subjects"] = [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}]
            out.append(d)
    return out


# --------------------------------------------------------------------------- probes


def _https(port: int, ca_file: str, method: str, path: str, body: bytes | None = None) -> int:
    ctx = ssl.create_default_context(cafile=ca_file)
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _http_ok(port: int, path: str) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status == 200
    finally:
        conn.close()


# --------------------------------------------------------------------------- the orchestration

# Kueue v0.17.0 with internal certificate management off loads a metrics serving certificate
# from this fixed path at start (cmd/kueue/main.go), even with the metrics server off, and exits
# without it. Its content does not matter here (metrics bindAddress "0": nothing serves it).
KUEUE_METRICS_CERTS = Path("/etc/kueue/metrics/certs")
# ... and its visibility API server's serving certificate from this one (pkg/visibility/server.go)
KUEUE_VISIBILITY_CERTS = Path("/visibility")


def visibility_objects(*, port: int, namespace: str, service_account: str) -> list[dict[str, Any]]:
    """What Kueue's ``config/components/visibility`` registers (its v1beta2 APIService, which
    skips TLS verification as upstream's does, and the delegated authentication's read access
    in kube-system) plus the delegation of authentication and authorization
    (``system:auth-delegator``), for a controller on loopback: the APIService's Service is an
    ExternalName ``localhost`` and its port the visibility server's own."""
    sa = {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "visibility-server", "namespace": namespace},
         "spec": {"type": "ExternalName", "externalName": "localhost"}},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
         "metadata": {"name": "v1beta2.visibility.kueue.x-k8s.io"},
         "spec": {"group": "visibility.kueue.x-k8s.io", "version": "v1beta2",
                  "groupPriorityMinimum": 100, "versionPriority": 100, "insecureSkipTLSVerify": True,
                  "service": {"name": "visibility-server", "namespace": namespace, "port": port}}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "visibility-server-auth-reader", "namespace": "kube-system"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                     "name": "extension-apiserver-authentication-reader"},
         "subjects": [sa]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "kueue-visibility-server-auth-delegator"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "system:auth-delegator"},
         "subjects": [sa]},
    ]


def _kueue_metrics_certs(ca: Any, folder: Path = KUEUE_METRICS_CERTS) -> list[Path]:
    """Make sure ``folder`` (``KUEUE_METRICS_CERTS``, ``KUEUE_VISIBILITY_CERTS``) has a
    tls.crt and tls.key (a throwaway pair for ``localhost`` if not); what it made (files, then
    the folders it created, innermost first), for `remove_made` when the control plane stops:
    nothing of the tests stays there."""
    from .controlplane import ControlPlaneError  # noqa: PLC0415 - a cycle

    crt, key = folder / "tls.crt", folder / "tls.key"
    if crt.is_file() and key.is_file():
        return []
    folders = [p for p in (folder, *folder.parents) if not p.exists()]
    made = [p for p in (key, crt) if not p.exists()] + folders
    try:
        folder.mkdir(parents=True, exist_ok=True)
        pem_crt, pem_key = ca.issue("kueue-localhost", server_names=["localhost"], server_ips=["127.0.0.1"],
                                    client=False, server=True)
        for path, data, mode in ((key, pem_key, 0o600), (crt, pem_crt, 0o644)):
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_bytes(data)
            tmp.chmod(mode)
            os.replace(tmp, path)
    except OSError as e:
        remove_made(made)
        raise ControlPlaneError(
            f"Kueue needs a certificate in {folder} and it cannot be written: {e}; create "
            f"tls.crt and tls.key there once (any pair for localhost)") from e
    return made


def remove_made(paths: list[Path]) -> None:
    """Remove what `_kueue_metrics_certs` made (folders only when empty)."""
    for p in paths:
        try:
            p.rmdir() if p.is_dir() else p.unlink()
        except OSError:
            pass


def start_queueing(cp: ControlPlane, deadline: float) -> None:
    """Install and start Kueue and JobSet on the started control plane ``cp`` (module docstring)."""
    from .controlplane import BUILD_SCRIPT, ControlPlaneError, free_port, kubeconfig_dict  # noqa: PLC0415 - a cycle

    ca = cp._ca
    assert ca is not None
    ports = {name: (free_port(), free_port()) for name in CONTROLLERS}  # webhook, health
    manifests = {}
    for name, (_, _, folder) in CONTROLLERS.items():
        d = cp.bin_dir / folder
        if not (d / "config" / "components" / "crd" / "kustomization.yaml").is_file():
            raise ControlPlaneError(f"no {name} manifests in {d}; run {BUILD_SCRIPT} {name}")
        manifests[name] = d / "config" / "components"

    crds: list[dict[str, Any]] = []
    for name in CONTROLLERS:
        crds += kustomize_crds(manifests[name] / "crd", port=ports[name][0], ca_pem=cp._ca_pem)
    for name, (namespace, sa, _) in CONTROLLERS.items():
        crds += manager_rbac(manifests[name] / "rbac", name=name, namespace=namespace, service_account=sa)
    cp.apply(*crds)
    crd_names = [f"crd/{d['metadata']['name']}" for d in crds if d["kind"] == "CustomResourceDefinition"]
    cp._wait(deadline, "Kueue and JobSet CRDs Established",
             lambda: cp.kubectl("wait", "--for=condition=Established", "--timeout=20s", *crd_names,
                                check=False).returncode == 0)

    cp._made_outside += _kueue_metrics_certs(ca)
    cp._made_outside += _kueue_metrics_certs(ca, KUEUE_VISIBILITY_CERTS)
    # before Kueue starts: its visibility server reads the API server's authentication
    # configuration once, at start, and Kueue exits where it may not
    visibility_port = free_port()
    namespace, sa, _ = CONTROLLERS["kueue"]
    cp.apply(*visibility_objects(port=visibility_port, namespace=namespace, service_account=sa))
    builders = {"kueue": functools.partial(kueue_configuration, visibility_port=visibility_port),
                "jobset": jobset_configuration}
    for name, (namespace, sa, _) in CONTROLLERS.items():
        home = cp._path(name)
        certs = home / "certs"
        crt, key = ca.issue(name, server_ips=["127.0.0.1"], server_names=["localhost"], client=False, server=True)
        cp._write(certs / "tls.crt", crt)
        cp._write(certs / "tls.key", key, 0o600)
        user = f"system:serviceaccount:{namespace}:{sa}"
        crt, key = ca.issue(user, organizations=["system:serviceaccounts", f"system:serviceaccounts:{namespace}"])
        kubeconfig = home / "kubeconfig"
        cp._write(kubeconfig, yaml.safe_dump(kubeconfig_dict(
            server=cp.server, ca_pem=cp._ca_pem, user=user, cert_pem=crt, key_pem=key), sort_keys=False), 0o600)
        config = home / "config.yaml"
        settings = builders[name](webhook_port=ports[name][0], health_port=ports[name][1], cert_dir=str(certs))
        if name == "kueue":
            settings.update(copy.deepcopy(cp.kueue_settings))  # the operator's own, on top
        cp._write(config, yaml.safe_dump(settings, sort_keys=False))
        # --kubeconfig too: Kueue's visibility server delegates authentication and
        # authorization to the API server named by that flag (KUBECONFIG is not read there)
        argv = [str(cp.bin_dir / name), f"--config={config}", f"--kubeconfig={kubeconfig}",
                "--zap-log-level=info"]
        if name == "jobset":
            argv.append("--metrics-bind-address=0")  # as the file says; explicit, the flag default is :8443
        cp._spawn(name, argv, env={"KUBECONFIG": str(kubeconfig), "HOME": str(home), "PATH": "/usr/bin:/bin"})

    for name in CONTROLLERS:
        cp._wait(deadline, f"{name} /readyz", lambda n=name: _http_ok(ports[n][1], "/readyz"))

    webhooks: list[dict[str, Any]] = []
    for name in CONTROLLERS:
        port = ports[name][0]
        # a path the controller does not serve answers 404; a served one answers a bad review 200/400
        served = lambda path, port=port: _https(port, cp.ca_file, "POST", path, b"{}") != 404  # noqa: E731
        docs = kustomize_webhooks(manifests[name] / "webhook")
        keep = served
        if name in REGISTERS_WEBHOOKS_LATE:
            # its /readyz passes before its handlers exist: a path probed in between would
            # answer 404 and its webhook be left out for good (the JobSet never mutated)
            paths = [w["clientConfig"]["service"]["path"] for d in docs for w in d["webhooks"]]
            cp._wait(deadline, f"{name}'s webhook handlers", lambda paths=paths, ok=served: all(map(ok, paths)))
            keep = None
        webhooks += loopback_webhooks(docs, prefix=name, port=port, ca_pem=cp._ca_pem, keep_path=keep)
    cp.apply(*webhooks)

    flavor = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
              "metadata": {"name": "gpulab-probe"}, "spec": {}}
    # in a LocalQueue and not suspended: Kueue's webhook suspends it, JobSet's defaults its
    # network (DNS host names on)
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": "gpulab-probe", "namespace": "default",
                     "labels": {"kueue.x-k8s.io/queue-name": "gpulab-probe"}},
        "spec": {"replicatedJobs": [{"name": "r", "replicas": 1, "template": {"spec": {
            "template": {"spec": {"restartPolicy": "Never",
                                  "containers": [{"name": "c", "image": "registry.invalid/probe:1"}]}}}}}]},
    }
    # Kueue's pod webhook gates a pod of a LocalQueue until admission
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "gpulab-probe", "namespace": "default",
                        "labels": {"kueue.x-k8s.io/queue-name": "gpulab-probe"}},
           "spec": {"containers": [{"name": "c", "image": "registry.invalid/probe:1"}]}}

    def mutated(obj: dict[str, Any]) -> bool:
        if obj["kind"] == "JobSet":
            return (obj["spec"].get("suspend") is True
                    and (obj["spec"].get("network") or {}).get("enableDNSHostnames") is True)
        if obj["kind"] == "Pod":
            return {"name": "kueue.x-k8s.io/admission"} in obj["spec"].get("schedulingGates", [])
        return True

    def dry_run_passes() -> bool:
        # the API server calls webhooks only once it has read their configurations, a moment
        # after they are applied: until both mutate, an object made would miss their defaults
        # (a JobSet without its network makes JobSet's controller panic on it for ever)
        for obj in (flavor, jobset, pod):
            r = cp.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(obj), check=False)
            if r.returncode != 0:
                raise ControlPlaneError(r.stderr.strip())
            if not mutated(json.loads(r.stdout)):
                return False
        return True

    cp._wait(deadline, "the Kueue and JobSet webhooks (server-side dry runs)", dry_run_passes)

    # Kueue's visibility API through the API server (the aggregation layer)
    def visibility_available() -> bool:
        status, body = cp.api("GET", "/apis/apiregistration.k8s.io/v1/apiservices/v1beta2.visibility.kueue.x-k8s.io")
        return status == 200 and any(c.get("type") == "Available" and c.get("status") == "True"
                                     for c in body.get("status", {}).get("conditions", []))

    cp._wait(deadline, "Kueue's visibility API (APIService Available)", visibility_available)
