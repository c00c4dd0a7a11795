"""A real Kubernetes control plane on loopback for the cluster test tier.

``ControlPlane`` runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok from
``tests/cluster/bin/`` (built by ``tests/cluster/build.sh``) in a fresh temporary folder, on free
loopback ports, with its own CA and certificates. Nothing is mocked but the kubelets: kwok plays
them, moving pods bound to its nodes through the lifecycle its Stages describe (by default
``stages/default.yaml``: Running at once; Job pods then Succeeded; deleted pods removed).

The fake nodes (``DEFAULT_NODES``), each with 64 cpu, 512Gi memory and 110 pods:

=============  =============================  ======================  =========================
node           label nvidia.com/gpu.product   nvidia.com/gpu          taint
=============  =============================  ======================  =========================
gpu-h100-0..2  NVIDIA-H100                    8 each                  nvidia.com/gpu=present:NoSchedule
gpu-a10-0      NVIDIA-A10                     4                       nvidia.com/gpu=present:NoSchedule
cpu-0          (none)                         0                       (none)
=============  =============================  ======================  =========================

Every GPU node carries the taint ``nvidia.com/gpu=present:NoSchedule`` (``GPU_TAINT``), as GPU
node pools on real clusters do, so a GPU pod needs the toleration ``GPU_TOLERATION`` (key
``nvidia.com/gpu``, operator ``Exists``, effect ``NoSchedule``) and only GPU pods land on GPU
nodes. kwok manages only nodes annotated ``kwok.x-k8s.io/node=fake``.

The API server runs with ``--authorization-mode=Node,RBAC`` and the default admission plugins
plus NodeRestriction, ResourceQuota and PodSecurity; the controller manager runs every default
controller (``--controllers=*``) with per-controller service-account credentials, so namespaces,
garbage collection, quotas, Jobs, service accounts and their tokens work as on a real cluster.

With ``ControlPlane(queueing=True)`` it also runs Kueue v0.17.0 and JobSet v0.11.1 (built by
build.sh from their own Go modules, ``kueue/`` and ``jobset/``) as processes: their CRDs, their
own ClusterRoles bound to their ServiceAccounts (the controllers authenticate as those with a
client certificate), their webhooks on loopback with a CA bundle, and a Kueue configuration
with the ``batch/job``, ``jobset.x-k8s.io/jobset`` and ``pod`` integrations (kube-system exempt),
fair sharing and waitForPodsReady. ``queueing.py`` has the details; logs are ``logs/kueue.log``
and ``logs/jobset.log``. Off by default: the other tests pay nothing for it.

Use::

    with ControlPlane() as cp:
        cp.kubectl("get", "nodes")
        nodes = cp.kubectl_json("get", "nodes")
        kubeconfig = cp.service_account_kubeconfig("team-a", "reader")

or for a person: ``tests/cluster/up.sh`` (``python -m tests.cluster.controlplane``), which prints
the ``export KUBECONFIG=...`` line and runs until Ctrl-C.

Environment: ``GPULAB_CLUSTER_KEEP=1`` keeps the temporary folder (certificates, kubeconfigs,
component logs under ``logs/``) after ``stop()``, for a post-mortem.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import ctypes
import datetime
import http.client
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .queueing import QUEUEING_BINARIES, remove_made, start_queueing

HERE = Path(__file__).resolve().parent
BIN_DIR = HERE / "bin"
BUILD_SCRIPT = HERE / "build.sh"
DEFAULT_STAGES = HERE / "stages" / "default.yaml"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubectl")

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
SERVICE_CIDR = "10.96.0.0/16"
FRONT_PROXY_CLIENT = "front-proxy-client"  # the aggregation layer's client certificate's name
POD_CIDR = "10.244.0.1/16"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


class ControlPlaneError(RuntimeError):
    """The control plane could not start (the message ends with the components' log tails)."""


class ComponentExited(ControlPlaneError):
    """A component process exited while the control plane was starting."""


class KubectlError(subprocess.CalledProcessError):
    """kubectl exited non-zero; ``str()`` includes its stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {(self.stderr or '').strip()}"


# --------------------------------------------------------------------------- pure builders


def fake_node(
    name: str,
    *,
    gpu_product: str | None = None,
    gpus: int = 0,
    cpu: str = "64",
    memory: str = "512Gi",
    pods: int = 110,
) -> dict[str, Any]:
    """A Node object for kwok to manage; a GPU node gets the product label and ``GPU_TAINT``."""
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
    }
    resources = {"cpu": cpu, "memory": memory, "pods": str(pods), "ephemeral-storage": "1Ti"}
    spec: dict[str, Any] = {}
    if gpus:
        labels[GPU_PRODUCT_LABEL] = gpu_product or "NVIDIA-GPU"
        labels["nvidia.com/gpu.count"] = str(gpus)
        labels["nvidia.com/gpu.present"] = "true"
        resources[GPU_RESOURCE] = str(gpus)
        spec["taints"] = [dict(GPU_TAINT)]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": spec,
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


DEFAULT_NODES: tuple[dict[str, Any], ...] = (
    *(fake_node(f"gpu-h100-{i}", gpu_product="NVIDIA-H100", gpus=8) for i in range(3)),
    fake_node("gpu-a10-0", gpu_product="NVIDIA-A10", gpus=4),
    fake_node("cpu-0"),
)


def kubeconfig_dict(
    *,
    server: str,
    ca_pem: bytes,
    user: str,
    cert_pem: bytes | None = None,
    key_pem: bytes | None = None,
    token: str | None = None,
    namespace: str | None = None,
    cluster: str = "gpulab-test",
) -> dict[str, Any]:
    """A self-contained kubeconfig (certificates inline) for a client certificate or a token."""
    creds: dict[str, str] = {}
    if cert_pem is not None and key_pem is not None:
        creds["client-certificate-data"] = base64.b64encode(cert_pem).decode()
        creds["client-key-data"] = base64.b64encode(key_pem).decode()
    if token is not None:
        creds["token"] = token
    context: dict[str, str] = {"cluster": cluster, "user": user}
    if namespace:
        context["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster,
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": f"{user}@{cluster}", "context": context}],
        "current-context": f"{user}@{cluster}",
    }


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    check: Callable[[], Any],
    *,
    timeout: float,
    what: str,
    interval: float = 0.1,
    max_interval: float = 1.0,
    on_timeout: Callable[[], str] | None = None,
    fatal: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``check`` until it returns something truthy and return that; raise ``TimeoutError``.

    ``check`` may raise; the last exception (or ``on_timeout()``) is put in the message.
    Exceptions of the ``fatal`` types are not retried but raised at once.
    The interval grows from ``interval`` to ``max_interval`` (seconds).
    """
    deadline = time.monotonic() + timeout
    last: str = "never true"
    while True:
        try:
            result = check()
            if result:
                return result
        except fatal:
            raise
        except Exception as e:  # noqa: BLE001 - reported below
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            detail = on_timeout() if on_timeout else last
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}: {detail}")
        time.sleep(interval)
        interval = min(interval * 1.5, max_interval)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


class _CA:
    """A throwaway certificate authority (ECDSA P-256, valid for a few days)."""

    def __init__(self, common_name: str = "gpulab-test-ca"):
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                    key_encipherment=False, data_encipherment=False, key_agreement=False,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self,
        common_name: str,
        *,
        organizations: Sequence[str] = (),
        server_names: Sequence[str] = (),
        server_ips: Sequence[str] = (),
        client: bool = True,
        server: bool = False,
    ) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) for a client and/or server identity signed by this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        usages = []
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_encipherment=False, key_cert_sign=False, crl_sign=False,
                    content_commitment=False, data_encipherment=False, key_agreement=False,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
        )
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return _pem_cert(builder.sign(self.key, hashes.SHA256())), _pem_key(key)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """Ask Linux to SIGTERM the child when the process that started it dies (even by SIGKILL)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _Process:
    """One component: its command line, its log file, its pid."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.name, self.argv, self.log, self.env = name, argv, log, env
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # Ctrl-C reaches us, and we stop them in order
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )

    def exited(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def terminate(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGTERM)

    def wait_or_kill(self, timeout: float) -> None:
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout=max(timeout, 0.01))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)

    def tail(self, lines: int) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text[-lines:])


# --------------------------------------------------------------------------- the control plane


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok on loopback.

    Parameters (all keyword-only):

    bin_dir
        Where the six binaries are (default ``tests/cluster/bin``).
    nodes
        Node objects to register (default ``DEFAULT_NODES``); each should carry the
        ``kwok.x-k8s.io/node: fake`` annotation so that kwok manages it.
    kwok_stages
        kwok Stage files (default ``[DEFAULT_STAGES]``). Pass your own to decide when pods
        become Running, fail or finish.
    kwok_enable_crds
        kwok kinds to read from the API instead of files (``--enable-crds``), e.g. ``["Stage"]``.
        kwok's CRDs (copied into ``bin/kwok-crds`` by build.sh) are installed first; with
        ``"Stage"`` the ``kwok_stages`` files are created as Stage objects, which tests may then
        edit, add or delete through the API.
    kwok_args
        Extra kwok command-line arguments.
    queueing
        Also run Kueue v0.17.0 and JobSet v0.11.1 (``queueing.py`` says how: CRDs, RBAC, loopback
        webhooks, Kueue's configuration). Off by default: it adds about 10-15 seconds to
        ``start()`` and needs ``bin/kueue``, ``bin/jobset`` and their manifests (build.sh).
    kueue_settings
        Top-level sections of Kueue's configuration that replace or add to
        ``queueing.kueue_configuration``'s (an operator's choice, e.g. ``resources``).
    start_timeout
        Seconds ``start()`` may take before it fails with the components' log tails.
    keep_dir
        Keep the temporary folder after ``stop()`` (default: ``GPULAB_CLUSTER_KEEP`` is set).
    """

    def __init__(
        self,
        *,
        bin_dir: Path | str = BIN_DIR,
        nodes: Iterable[dict[str, Any]] = DEFAULT_NODES,
        kwok_stages: Sequence[Path | str] | None = None,
        kwok_enable_crds: Sequence[str] = (),
        kwok_args: Sequence[str] = (),
        queueing: bool = False,
        kueue_settings: dict[str, Any] | None = None,
        start_timeout: float | None = None,
        keep_dir: bool | None = None,
    ):
        self.bin_dir = Path(bin_dir)
        self.nodes = [json.loads(json.dumps(n)) for n in nodes]
        self.kwok_stages = [Path(p) for p in (kwok_stages if kwok_stages is not None else [DEFAULT_STAGES])]
        self.kwok_enable_crds = list(kwok_enable_crds)
        self.kwok_args = list(kwok_args)
        self.queueing = queueing
        self.kueue_settings = dict(kueue_settings or {})
        #: files and folders made outside self.dir (removed by stop)
        self._made_outside: list[Path] = []
        if start_timeout is None:
            start_timeout = 240.0 if queueing else 120.0
        self.start_timeout = start_timeout
        self.keep_dir = bool(os.environ.get("GPULAB_CLUSTER_KEEP")) if keep_dir is None else keep_dir
        self.dir: Path | None = None
        self.startup_seconds: float | None = None
        self._procs: list[_Process] = []
        self._ports: dict[str, int] = {}
        self._ca: _CA | None = None
        self._ca_pem = b""
        self._ssl: ssl.SSLContext | None = None
        self._sa_count = 0

    # -- public properties

    @property
    def server(self) -> str:
        """The API server URL, ``https://127.0.0.1:<port>``."""
        return f"https://127.0.0.1:{self._ports['apiserver']}"

    @property
    def api_port(self) -> int:
        """The API server's port on 127.0.0.1."""
        return self._ports["apiserver"]

    @property
    def ca_pem(self) -> bytes:
        """The cluster CA certificate (PEM)."""
        return self._ca_pem

    def issue_certificate(self, common_name: str, **kwargs: Any) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) signed by the cluster CA (``_CA.issue``'s arguments): for a
        node's kubelet (``system:node:NAME`` in ``system:nodes``) and its serving certificate."""
        assert self._ca is not None, "start the control plane first"
        return self._ca.issue(common_name, **kwargs)

    @property
    def kubeconfig(self) -> str:
        """Path of the admin kubeconfig (client certificate CN=admin, O=system:masters)."""
        return str(self._path("admin.kubeconfig"))

    @property
    def ca_file(self) -> str:
        """Path of the cluster CA certificate (PEM)."""
        return str(self._path("pki", "ca.crt"))

    @property
    def logs_dir(self) -> Path:
        return self._path("logs")

    @property
    def node_names(self) -> list[str]:
        return [n["metadata"]["name"] for n in self.nodes]

    # -- lifecycle

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        """Start everything and wait until the cluster is usable; raise ``ControlPlaneError``."""
        if self.dir is not None:
            raise ControlPlaneError("this ControlPlane is already started")
        wanted = BINARIES + (QUEUEING_BINARIES if self.queueing else ())
        missing = [b for b in wanted if not os.access(self.bin_dir / b, os.X_OK)]
        if missing:
            raise ControlPlaneError(
                f"missing binaries in {self.bin_dir}: {', '.join(missing)}; run {BUILD_SCRIPT}"
            )
        t0 = time.monotonic()
        deadline = t0 + self.start_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="gpulab-k8s-"))
        atexit.register(self.stop)
        try:
            self._write_pki_and_configs()
            self._spawn("etcd", self._etcd_argv())
            self._spawn("kube-apiserver", self._apiserver_argv())
            self._wait(deadline, "kube-apiserver /readyz", self._apiserver_ready)
            self._spawn("kube-controller-manager", self._controller_manager_argv())
            self._spawn("kube-scheduler", self._scheduler_argv())
            self._install_kwok_crds(deadline)
            self._spawn("kwok", self._kwok_argv(), env={**os.environ, "HOME": str(self._path("kwok-home"))})
            for node in self.nodes:
                self.api("POST", "/api/v1/nodes", node, expect=(201,))
            self._wait(deadline, "the default ServiceAccount in namespace default", self._default_sa_ready)
            self._wait(deadline, "the resource quota controller", self._quota_controller_live)
            self._wait(deadline, "kube-scheduler /healthz", lambda: self._component_healthy("scheduler"))
            self._wait(deadline, f"nodes {', '.join(self.node_names)} Ready", self._nodes_ready)
            if self.queueing:
                start_queueing(self, deadline)
        except BaseException as e:
            tails = self.log_tails()
            self.stop()
            if isinstance(e, (ControlPlaneError, TimeoutError, OSError, http.client.HTTPException)):
                keep = "" if self.keep_dir else " (GPULAB_CLUSTER_KEEP=1 keeps the logs)"
                raise ControlPlaneError(f"control plane did not start: {e}{keep}\n{tails}") from e
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Stop the processes this object started (SIGTERM, then SIGKILL) and remove its folder."""
        atexit.unregister(self.stop)
        procs = [p for p in self._procs if p.name != "etcd"]
        for p in procs:
            p.terminate()
        end = time.monotonic() + 10
        for p in procs:
            p.wait_or_kill(end - time.monotonic())
        for p in self._procs:
            if p.name == "etcd":
                p.terminate()
                p.wait_or_kill(5)
        self._procs = []
        remove_made(self._made_outside)  # Kueue's metrics certificate in /etc, if made here
        self._made_outside = []
        if self.dir is not None and not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    # -- clients

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60,
        kubeconfig: str | os.PathLike[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl ARGS`` as admin (or with ``kubeconfig``); raise ``KubectlError`` if ``check``."""
        argv = [str(self.bin_dir / "kubectl"), *args]
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig or self.kubeconfig),
            "KUBECACHEDIR": str(self._path("kubectl-cache")),
        }
        r = subprocess.run(argv, input=input, capture_output=True, text=True, env=env, timeout=timeout)
        if check and r.returncode != 0:
            raise KubectlError(r.returncode, ["kubectl", *args], r.stdout, r.stderr)
        return r

    def kubectl_json(self, *args: str, **kwargs: Any) -> Any:
        """``kubectl ARGS -o json``, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", **kwargs).stdout)

    def apply(self, *objects: dict[str, Any]) -> None:
        """``kubectl apply`` the given objects (server-side)."""
        doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=doc)

    def api(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        expect: Sequence[int] | None = None,
        content_type: str = "application/json",
        timeout: float = 30,
    ) -> tuple[int, Any]:
        """One admin request to the API server: (status, parsed JSON body or text).

        With ``expect``, any other status raises ``ControlPlaneError``.
        """
        assert self._ssl is not None, "not started"
        conn = http.client.HTTPSConnection("127.0.0.1", self._ports["apiserver"], context=self._ssl, timeout=timeout)
        try:
            data = None if body is None else (body if isinstance(body, (bytes, str)) else json.dumps(body))
            headers = {"Accept": "application/json"}
            if data is not None:
                headers["Content-Type"] = content_type
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read().decode(errors="replace")
        finally:
            conn.close()
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw
        if expect is not None and resp.status not in expect:
            raise ControlPlaneError(f"{method} {path}: HTTP {resp.status}: {raw[:500]}")
        return resp.status, parsed

    def create_namespace(self, name: str, *, labels: dict[str, str] | None = None, timeout: float = 30) -> None:
        """Create a namespace and wait for its ``default`` ServiceAccount (pods need it)."""
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
        self.api("POST", "/api/v1/namespaces", ns, expect=(201,))
        self.wait_for_service_account(name, "default", timeout=timeout)

    def wait_for_service_account(self, namespace: str, name: str, *, timeout: float = 30) -> None:
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}"
        wait_until(lambda: self.api("GET", path)[0] == 200, timeout=timeout,
                   what=f"ServiceAccount {namespace}/{name}")

    def service_account_kubeconfig(
        self,
        namespace: str,
        name: str = "default",
        *,
        create: bool = True,
        expiration_seconds: int = 3600,
    ) -> str:
        """A kubeconfig that authenticates as ServiceAccount ``namespace/name`` with a bound token.

        The ServiceAccount is created if ``create`` and missing; it gets no RBAC here: grant
        what a test needs with Roles and RoleBindings. Returns the kubeconfig's path; its
        context's default namespace is ``namespace``.
        """
        base = f"/api/v1/namespaces/{namespace}/serviceaccounts"
        if create and self.api("GET", f"{base}/{name}")[0] == 404:
            sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}
            self.api("POST", base, sa, expect=(201, 409))
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": expiration_seconds},
        }
        _, tr = self.api("POST", f"{base}/{name}/token", request, expect=(201,))
        self._sa_count += 1
        path = self._path("kubeconfigs", f"sa-{namespace}-{name}-{self._sa_count}.kubeconfig")
        cfg = kubeconfig_dict(
            server=self.server, ca_pem=self._ca_pem, user=f"system:serviceaccount:{namespace}:{name}",
            token=tr["status"]["token"], namespace=namespace,
        )
        self._write(path, yaml.safe_dump(cfg, sort_keys=False), mode=0o600)
        return str(path)

    def log_tails(self, lines: int = 30) -> str:
        """The last ``lines`` lines of every component's log, each under a header."""
        parts = []
        for p in self._procs:
            rc = p.exited()
            state = "running" if rc is None else f"exited {rc}"
            parts.append(f"----- {p.name} ({state}), {p.log} -----\n{p.tail(lines)}")
        return "\n".join(parts)

    # -- internals: files

    def _path(self, *parts: str) -> Path:
        if self.dir is None:
            raise ControlPlaneError("the control plane is not started")
        return self.dir.joinpath(*parts)

    @staticmethod
    def _write(path: Path, data: str | bytes, mode: int = 0o644) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        path.chmod(mode)

    def _write_pki_and_configs(self) -> None:
        for name in ("etcd", "apiserver", "controller-manager", "scheduler", "etcd-peer"):
            self._ports[name] = free_port()
        ca = self._ca = _CA()
        self._ca_pem = _pem_cert(ca.cert)
        pki = self._path("pki")
        self._write(pki / "ca.crt", self._ca_pem)
        self._write(pki / "ca.key", _pem_key(ca.key), 0o600)
        crt, key = ca.issue(
            "kube-apiserver",
            server_names=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                          "kubernetes.default.svc.cluster.local"],
            server_ips=["127.0.0.1", "10.96.0.1"],
            client=False, server=True,
        )
        self._write(pki / "apiserver.crt", crt)
        self._write(pki / "apiserver.key", key, 0o600)
        # the API server's identity towards kubelets (logs, exec, port-forward of a real node)
        crt, key = ca.issue("kube-apiserver-kubelet-client", organizations=["system:masters"])
        self._write(pki / "apiserver-kubelet-client.crt", crt)
        self._write(pki / "apiserver-kubelet-client.key", key, 0o600)
        # the aggregation layer's client (Kueue's visibility API server): it authenticates
        # the requests it proxies by this certificate and the X-Remote-* headers
        crt, key = ca.issue(FRONT_PROXY_CLIENT)
        self._write(pki / "front-proxy-client.crt", crt)
        self._write(pki / "front-proxy-client.key", key, 0o600)
        sa_key = ec.generate_private_key(ec.SECP256R1())
        self._write(pki / "sa.key", _pem_key(sa_key), 0o600)
        self._write(pki / "sa.pub", sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        identities = {
            "admin": ("admin", ["system:masters"]),
            "controller-manager": ("system:kube-controller-manager", []),
            "scheduler": ("system:kube-scheduler", []),
            "kwok": ("kwok", ["system:masters"]),
        }
        for file, (cn, orgs) in identities.items():
            crt, key = ca.issue(cn, organizations=orgs)
            if file == "admin":
                self._write(pki / "admin.crt", crt)
                self._write(pki / "admin.key", key, 0o600)
            cfg = kubeconfig_dict(server=self.server, ca_pem=self._ca_pem, user=cn, cert_pem=crt, key_pem=key)
            self._write(self._path(f"{file}.kubeconfig"), yaml.safe_dump(cfg, sort_keys=False), 0o600)
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self._ssl = ctx
        self.logs_dir.mkdir()
        self._path("kwok-home").mkdir()

    # -- internals: command lines

    def _etcd_argv(self) -> list[str]:
        client = f"http://127.0.0.1:{self._ports['etcd']}"
        peer = f"http://127.0.0.1:{self._ports['etcd-peer']}"
        return [
            str(self.bin_dir / "etcd"),
            "--name=gpulab-test",
            f"--data-dir={self._path('etcd')}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=gpulab-test={peer}",
            "--unsafe-no-fsync=true",  # a throwaway store; fsync only slows the tests down
            "--log-level=warn",
        ]

    def _apiserver_argv(self) -> list[str]:
        pki = self._path("pki")
        return [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self._ports['etcd']}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            # The endpoint reconciler refuses a loopback address for the `kubernetes` Service;
            # clients here use the kubeconfig, not in-cluster discovery.
            "--endpoint-reconciler-type=none",
            f"--secure-port={self._ports['apiserver']}",
            f"--cert-dir={self._path('apiserver')}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            # (no --kubelet-certificate-authority: kwok's kubelet API, which some tests serve
            # pod logs from, has a self-signed certificate)
            # a real node's kubelet at its address (node.py): no DNS names nodes here
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            # the aggregation layer, for API servers of extensions (Kueue's visibility API)
            f"--requestheader-client-ca-file={pki / 'ca.crt'}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction,ResourceQuota,PodSecurity",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ]

    def _controller_manager_argv(self) -> list[str]:
        pki = self._path("pki")
        return [
            str(self.bin_dir / "kube-controller-manager"),
            f"--kubeconfig={self._path('controller-manager.kubeconfig')}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self._ports['controller-manager']}",
            f"--cert-dir={self._path('controller-manager')}",
            "--leader-elect=false",
            "--controllers=*",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--cluster-name=gpulab-test",
            "--profiling=false",
            "--v=1",
        ]

    def _scheduler_argv(self) -> list[str]:
        return [
            str(self.bin_dir / "kube-scheduler"),
            f"--kubeconfig={self._path('scheduler.kubeconfig')}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self._ports['scheduler']}",
            f"--cert-dir={self._path('scheduler')}",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ]

    def _kwok_argv(self) -> list[str]:
        argv = [
            str(self.bin_dir / "kwok"),
            f"--kubeconfig={self._path('kwok.kubeconfig')}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
            f"--cidr={POD_CIDR}",
            "--node-ip=10.240.0.1",
            "--node-lease-duration-seconds=40",
        ]
        if self.kwok_enable_crds:
            argv.append(f"--enable-crds={','.join(self.kwok_enable_crds)}")
        if "Stage" not in self.kwok_enable_crds:
            argv += [f"--config={p}" for p in self.kwok_stages]
        return argv + self.kwok_args

    def _install_kwok_crds(self, deadline: float) -> None:
        if not self.kwok_enable_crds:
            return
        crd_dir = self.bin_dir / "kwok-crds"
        files = sorted(crd_dir.glob("*.yaml"))
        if not files:
            raise ControlPlaneError(f"no kwok CRDs in {crd_dir}; run {BUILD_SCRIPT} kwok")
        self.kubectl("apply", "--server-side", *(f"-f={f}" for f in files))
        self._wait(
            deadline, "kwok CRDs Established",
            lambda: self.kubectl("wait", "--for=condition=Established", "--timeout=1s",
                                 *(f"-f={f}" for f in files), check=False).returncode == 0,
        )
        if "Stage" in self.kwok_enable_crds and self.kwok_stages:
            self.kubectl("apply", "--server-side", *(f"-f={p}" for p in self.kwok_stages))

    # -- internals: processes and readiness

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        p = _Process(name, argv, self.logs_dir / f"{name}.log", env)
        with open(p.log, "w") as f:
            f.write("$ " + " ".join(argv) + "\n")
        p.start()
        self._procs.append(p)

    def _wait(self, deadline: float, what: str, check: Callable[[], Any]) -> None:
        def fail_fast() -> Any:
            for p in self._procs:
                rc = p.exited()
                if rc is not None:
                    raise ComponentExited(f"{p.name} exited with status {rc} while waiting for {what}")
            try:
                return check()
            except Exception:  # noqa: BLE001 - not yet; _last_error reports it on timeout
                return False

        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ControlPlaneError(f"start timeout ({self.start_timeout:.0f}s) spent before {what}")
        try:
            wait_until(fail_fast, timeout=remaining, what=what,
                       on_timeout=lambda: self._last_error(check), fatal=(ComponentExited,))
        except TimeoutError as e:
            raise ControlPlaneError(str(e)) from e

    @staticmethod
    def _last_error(check: Callable[[], Any]) -> str:
        try:
            return f"last result {check()!r}"
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"

    def _apiserver_ready(self) -> bool:
        status, body = self.api("GET", "/readyz", timeout=5)
        return status == 200

    def _default_sa_ready(self) -> bool:
        return self.api("GET", "/api/v1/namespaces/default/serviceaccounts/default", timeout=5)[0] == 200

    def _quota_controller_live(self) -> bool:
        """True once the quota controller has computed the status of a probe ResourceQuota."""
        base = "/api/v1/namespaces/kube-system/resourcequotas"
        status, rq = self.api("GET", f"{base}/gpulab-probe", timeout=5)
        if status == 404:
            probe = {"apiVersion": "v1", "kind": "ResourceQuota",
                     "metadata": {"name": "gpulab-probe"}, "spec": {"hard": {"count/configmaps": "10000"}}}
            self.api("POST", base, probe, expect=(201, 409))
            return False
        if not rq.get("status", {}).get("hard"):
            return False
        self.api("DELETE", f"{base}/gpulab-probe", expect=(200, 404))
        return True

    def _component_healthy(self, name: str) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the component's own self-signed serving certificate
        conn = http.client.HTTPSConnection("127.0.0.1", self._ports[name], context=ctx, timeout=5)
        try:
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
            return resp.status == 200 and resp.read().strip() == b"ok"
        finally:
            conn.close()

    def _nodes_ready(self) -> bool:
        _, nodes = self.api("GET", "/api/v1/nodes", expect=(200,), timeout=5)
        ready = {
            n["metadata"]["name"]
            for n in nodes["items"]
            if any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
        }
        return set(self.node_names) <= ready


# --------------------------------------------------------------------------- for people


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tests/cluster/up.sh",
        description="Run the gpulab test control plane in the foreground until Ctrl-C.",
    )
    parser.add_argument("--stages", action="append", metavar="FILE",
                        help="kwok Stage file (repeatable; default: tests/cluster/stages/default.yaml)")
    parser.add_argument("--enable-crds", default="", metavar="KINDS",
                        help="comma-separated kwok kinds read from the API, e.g. Stage")
    parser.add_argument("--queueing", action="store_true", help="also run Kueue and JobSet (see queueing.py)")
    parser.add_argument("--node", action="store_true",
                        help="also run a real node where pods run (see node.py; needs root)")
    parser.add_argument("--image", action="store_true",
                        help="with --node: also import gpulab.test/singleuser, made from this Python's "
                             "environment (see images.py; minutes the first time)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder on exit")
    args = parser.parse_args(argv)
    if args.image and not args.node:
        parser.error("--image needs --node")

    cp = ControlPlane(
        kwok_stages=args.stages,
        kwok_enable_crds=[k for k in args.enable_crds.split(",") if k],
        queueing=args.queueing,
        keep_dir=args.keep or None,
    )
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    print("starting the control plane ...", flush=True)
    node = None
    try:
        cp.start()
        if args.node:
            from .images import singleuser_archive
            from .node import Node

            print("starting the real node ...", flush=True)
            node = Node(cp, keep_dir=args.keep or None).start()
            if args.image:
                print("importing gpulab.test/singleuser ...", flush=True)
                node.import_image(singleuser_archive(Path(sys.prefix))[1])
    except ControlPlaneError as e:  # NodeError too
        print(e, file=sys.stderr)
        cp.stop()
        return 1
    except KeyboardInterrupt:
        if node is not None:
            node.stop()
        cp.stop()
        return 130
    try:
        print(f"ready in {cp.startup_seconds:.1f}s: {cp.server}, nodes {', '.join(cp.node_names)}")
        if node is not None:
            from .node import REAL_NODE_LABEL, REAL_NODE_TAINT

            print(f"real node {node.name}: pods need the label selector {'='.join(REAL_NODE_LABEL)} and "
                  f"a toleration of {REAL_NODE_TAINT['key']}={REAL_NODE_TAINT['value']}:{REAL_NODE_TAINT['effect']}; "
                  f"images: {', '.join(i for i in node.images() if not i.startswith('sha256:'))}")
        print(f"logs in {cp.logs_dir}")
        print(f"export KUBECONFIG={cp.kubeconfig}")
        print(f"kubectl: {cp.bin_dir / 'kubectl'}")
        print("Ctrl-C stops it.", flush=True)
        while True:
            for p in [*cp._procs, *(node._procs if node is not None else [])]:
                if p.exited() is not None:
                    print(f"{p.name} exited ({p.exited()}):\n{p.tail(30)}", file=sys.stderr)
                    return 1
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        if node is not None:
            node.stop()
        cp.stop()


if __name__ == "__main__":
    sys.exit(main())
