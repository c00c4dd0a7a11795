"""A user's Kubernetes namespace, prepared one way for notebook servers and training jobs.

`KubeGPUSpawner <gpulab.spawner.kube.KubeGPUSpawner>` (at every spawn) and `KubeJobBackend
<gpulab.hub.jobs.kube.KubeJobBackend>` (once per namespace per service process) both call
`prepare_user_namespace`, which:

1. applies the namespace, labelled for Pod Security enforcement (server-side apply);
2. makes its NetworkPolicies exactly so (`apply_network_policies`), before any pod of the
   namespace runs;
3. (not again for a namespace this process prepared) applies its ``default``
   ServiceAccount, whose token no pod mounts (`make_default_service_account`: the API server
   would wait for the controller-manager's before admitting the first pod);
4. registers the namespace with this event loop's `GPUQuotaMirror` and writes its GPU
   ResourceQuota if it differs from the user's effective gpulab quota (with Kueue instead:
   removes a ResourceQuota left from before, once per namespace and process, and never in a
   namespace step 1 has just made: the API server answers its apply 201 Created).

Steps 2-4 each need only the namespace: they are sent together once it is applied, so a
spawn waits for two round trips to the API server, not one per object; for a namespace this
process has prepared before (`PREPARED`: a returning person), together with step 1, one round
trip (a namespace deleted meanwhile answers 404: then it is done in two, as for a new one).

The ledger is read in a worker thread (`asyncio.to_thread`), here (the person's own quota)
and in the mirror's periodic sync (everyone's, in one query): the event loop never waits for
the ledger's lock.

The defaults of the settings the two classes share (`gpulab.hub.cluster.settings.KubeSettings`,
which both inherit; the hub fills the service's backend's from ``c.KubeGPUSpawner``) are
defined here once, so that they cannot drift apart.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import weakref
from typing import Any

from kubernetes_asyncio.client.rest import ApiException
from kubespawner.clients import shared_client

from gpulab.hub.quota.ledger import Ledger
from gpulab.hub.quota.policy import Quota, effective_quota

from .kubeobjects import (
    POD_SECURITY_LEVELS,
    QUOTA_NAME,
    make_default_service_account,
    make_gpu_quota,
    make_user_namespace,
    make_user_network_policies,
)

APPLY = "application/apply-patch+yaml"
FIELD_MANAGER = "gpulab-hub"

# -- the defaults KubeGPUSpawner and KubeJobBackend share (one namespace, quota and folder
#    per user, whichever of the two made them)

#: the user's namespace (KubeSpawner's template fields; the backend knows ``{username}``)
USER_NAMESPACE_TEMPLATE = "gpulab-{username}"
#: Pod Security Standard enforced in user namespaces
POD_SECURITY_LEVEL = "baseline"
#: seconds between two comparisons of the ledger's quotas with the ResourceQuotas
GPU_QUOTA_SYNC_INTERVAL = 3.0
#: where the shared storage appears in servers and replicas
SHARED_MOUNT_PATH = "/gpulab/shared"
#: the user's own folder on the shared storage
USER_SUBPATH_TEMPLATE = "users/{username}"
#: the read-only datasets folder on the shared storage ('' for none)
DATASETS_SUBPATH = "datasets"
#: what a container of a user namespace that names none of its own may use (written into
#: every pod the hub makes: `gpulab.hub.cluster.kubeobjects.with_container_defaults`): a
#: replica as the local backend bounds one (``c.GPUJobs.default_cpu`` / ``default_memory``),
#: and disk for a checkpoint or two beside the shared storage
DEFAULT_CONTAINER_LIMITS = {"cpu": "2", "memory": "8Gi", "ephemeral-storage": "20Gi"}
#: what such a container reserves on its node: small, so that a person's idle notebook or a
#: job's parameter server does not hold a node's CPUs from others
DEFAULT_CONTAINER_REQUESTS = {"cpu": "100m", "memory": "512Mi", "ephemeral-storage": "1Gi"}


#: the namespaces this process has prepared (`prepare_user_namespace`), by API client (one
#: cluster's): their objects are applied together with the namespace itself, in one round trip
PREPARED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


class NamespaceSettingsError(ValueError):
    """A setting of the namespace is wrong (found before any API request). ``network``:
    the NetworkPolicies' settings (``allowed_egress``, ``allowed_server_ingress``), else
    ``pod_security_level``. Each
    caller words it for its own readers."""

    def __init__(self, message: str, *, network: bool = False):
        super().__init__(message)
        self.network = network


def api_message(e: ApiException) -> str:
    """The ``message`` of an API server error (its Status body), or the raw body."""
    try:
        return str(json.loads(e.body).get("message", e.body))
    except (TypeError, ValueError, AttributeError):
        return str(e.body or e.reason)


class QuotaIndex:
    """``Ledger.quotas()`` rows indexed once by scope and name, so that a pass over
    everyone finds each person's quota in a lookup, not a scan of every row
    (bench/scale_kube.py: the Kueue mirror's pass at 500 people of 2,000 took 2.8 s)."""

    def __init__(self, quota_rows: list[dict]):
        def q(r: dict) -> Quota:
            return Quota(r["max_gpus"], r.get("max_per_request"), r.get("gpu_hours"),
                         r.get("window_hours"))

        self.default: Quota | None = None
        self.users: dict[str, Quota] = {}
        self.groups: dict[str, Quota] = {}
        for r in quota_rows:
            if r["scope"] == "default":
                self.default = q(r)
            elif r["scope"] == "user":
                self.users[r["name"]] = q(r)
            elif r["scope"] == "group":
                self.groups[r["name"]] = q(r)

    def effective(self, user: str, groups: tuple[str, ...]) -> tuple[Quota | None, str]:
        """``(quota or None, source)`` of ``user``, as `Ledger.effective` decides it."""
        by_group = {g: self.groups[g] for g in groups if g in self.groups}
        return effective_quota(self.default, by_group, self.users.get(user))


def effective_quota_of(quota_rows: list[dict], user: str,
                       groups: tuple[str, ...]) -> tuple[Quota | None, str]:
    """``(quota or None, source)`` of ``user`` from ``Ledger.quotas()`` rows, as
    `Ledger.effective` decides it (for many people, index the rows once: `QuotaIndex`)."""
    return QuotaIndex(quota_rows).effective(user, groups)


def effective_max_gpus(quota_rows: list[dict] | QuotaIndex, user: str,
                       groups: tuple[str, ...]) -> int | None:
    """The ``max_gpus`` of the quota that applies to ``user`` (None: no quota), from
    ``Ledger.quotas()`` rows or their `QuotaIndex`, as `Ledger.effective` decides it."""
    index = quota_rows if isinstance(quota_rows, QuotaIndex) else QuotaIndex(quota_rows)
    quota, _ = index.effective(user, groups)
    return None if quota is None else quota.max_gpus


async def apply_network_policies(policies: list[dict], api=None) -> int:
    """Make each of ``policies`` exactly so; returns how many had to be replaced.

    Server-side apply (one request each) makes a missing policy and takes back gpulab's fields;
    but it leaves alone what another field manager added (an extra rule, a label in a
    selector), so a policy whose stored ``spec`` still differs is then replaced whole.
    ``api``: a ``NetworkingV1Api`` (default: kubespawner's shared one).
    """
    api = api or shared_client("NetworkingV1Api")

    async def one(policy: dict) -> int:
        name, namespace = policy["metadata"]["name"], policy["metadata"]["namespace"]
        stored = await api.patch_namespaced_network_policy(
            name, namespace, policy, field_manager=FIELD_MANAGER, force=True,
            _content_type=APPLY)
        stored = api.api_client.sanitize_for_serialization(stored)
        if stored.get("spec") == policy["spec"]:
            return 0
        body = copy.deepcopy(policy)
        body["metadata"]["resourceVersion"] = stored["metadata"]["resourceVersion"]
        await api.replace_namespaced_network_policy(name, namespace, body,
                                                    field_manager=FIELD_MANAGER)
        return 1

    return sum(await asyncio.gather(*(one(p) for p in policies)))


class LedgerMirror:
    """What gpulab's mirrors of the ledger in Kubernetes share: ``users`` (namespace ->
    user, groups, label) registered, ``applied`` (namespace -> what was written last), an
    ``apply(namespace, want)`` of their own, and a ``sync`` every ``interval`` seconds that
    applies only what changed."""

    #: what a mirror writes, in words for the log
    what = "GPU quota"

    async def _apply_changed(self, wants: dict[str, Any]) -> int:
        """Apply the ``wants`` that differ from what was applied; returns how many."""
        n = 0
        for ns, want in wants.items():
            if ns in self.applied and self.applied[ns] == want:
                continue
            try:
                await self.apply(ns, want)
                n += 1
            except ApiException as e:
                self.log.warning("Could not update the %s of namespace %s: %s %s",
                                 self.what, ns, e.status, api_message(e))
        return n

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception:  # a ledger or API hiccup must not end the mirror
                self.log.exception("%s mirror: sync failed", self.what)


class GPUQuotaMirror(LedgerMirror):
    """Keeps each user namespace's ResourceQuota equal to the user's effective gpulab quota.

    One per process and event loop: `prepare_user_namespace` registers each user namespace;
    every ``interval`` seconds the mirror reads all quotas from the ledger (one query, in a
    worker thread) and writes only the ResourceQuotas whose limit changed (no API request
    otherwise).
    """

    _instances: dict[Any, GPUQuotaMirror] = {}

    def __init__(self, ledger: Ledger, api, interval: float, log: logging.Logger):
        self.ledger, self.api, self.interval, self.log = ledger, api, interval, log
        self.users: dict[str, tuple[str, tuple[str, ...], str]] = {}  # ns -> user, groups, label
        self.applied: dict[str, int | None] = {}  # ns -> max_gpus written last
        #: namespaces (with Kueue) whose ResourceQuota this process removed already
        self.cleared: set[str] = set()
        self._task: asyncio.Task | None = None

    @classmethod
    def for_loop(cls, ledger: Ledger, api, interval: float, log: logging.Logger) -> GPUQuotaMirror:
        loop = asyncio.get_running_loop()
        mirror = cls._instances.get(loop)
        if mirror is None or mirror.ledger is not ledger:
            if mirror is not None and mirror._task is not None:
                mirror._task.cancel()
            mirror = cls._instances[loop] = cls(ledger, api, interval, log)
        return mirror

    def register(self, namespace: str, user: str, groups: tuple[str, ...], label: str) -> None:
        self.users[namespace] = (user, groups, label)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def apply(self, namespace: str, max_gpus: int | None) -> None:
        """Write (or, for None, delete) the ResourceQuota of ``namespace`` (one request)."""
        user, _, label = self.users[namespace]
        if max_gpus is None:
            try:
                await self.api.delete_namespaced_resource_quota(QUOTA_NAME, namespace)
            except ApiException as e:
                if e.status != 404:
                    raise
        else:
            body = make_gpu_quota(namespace=namespace, max_gpus=max_gpus, user_label=label)
            await self.api.patch_namespaced_resource_quota(
                QUOTA_NAME, namespace, body, field_manager=FIELD_MANAGER, force=True,
                _content_type=APPLY)
        self.applied[namespace] = max_gpus
        self.log.info("GPU quota of %s (namespace %s): %s", user, namespace,
                      "none" if max_gpus is None else max_gpus)

    async def sync(self) -> int:
        """Write the ResourceQuotas that differ from the ledger; returns how many."""
        index = QuotaIndex(await asyncio.to_thread(self.ledger.quotas))
        return await self._apply_changed({
            ns: effective_max_gpus(index, user, groups)
            for ns, (user, groups, _) in list(self.users.items())})


async def prepare_user_namespace(
    *,
    api,
    ledger: Ledger,
    namespace: str,
    user: str,
    groups: tuple[str, ...],
    user_label: str,
    pod_security_level: str,
    hub_namespace: str,
    allowed_egress: list[dict],
    sync_interval: float,
    request_timeout: float,
    log: logging.Logger,
    server_port: int = 8888,
    server_component: str = "singleuser-server",
    allowed_server_ingress: list[dict] | tuple = (),
    networking=None,
    gpu_resource_quota: bool = True,
    namespace_made=None,
    namespace_remade=None,
) -> int:
    """Create or update ``namespace`` for ``user``: Pod Security labels, NetworkPolicies,
    GPU ResourceQuota (see the module's docstring). Returns how many API requests it made.

    ``api`` is a ``CoreV1Api``, ``networking`` a ``NetworkingV1Api`` (default: kubespawner's
    shared one). ``server_port`` and ``server_component`` are the notebook servers'
    (KubeSpawner's ``port`` and ``component_label``), for the policy that lets the hub and
    the proxy reach them; ``allowed_server_ingress``, the operator's further ingress rules
    for them. Each request may take ``request_timeout`` seconds
    (``asyncio.TimeoutError`` otherwise); ``sync_interval`` is the mirror's period when
    this call starts it. ``gpu_resource_quota`` False (Kueue admits the namespace's work,
    `gpulab.hub.cluster.kueuemirror`): no GPU ResourceQuota, and one left from before is removed
    (it would refuse the pods of preemptible work that borrows beyond the person's quota).
    (The operator's container defaults are no object here: every pod the hub makes carries
    them, `gpulab.hub.cluster.kubeobjects.with_container_defaults`.)
    ``namespace_made``: called (no arguments) once the namespace is there, or is taken to
    be (`PREPARED`), so that the caller's own objects in it go out with these;
    ``namespace_remade``: called when one taken to be there turns out deleted meanwhile (the
    caller's objects in it are gone too). Raises
    `NamespaceSettingsError` for a bad ``pod_security_level``, ``allowed_egress`` or
    ``allowed_server_ingress`` before any request, and the API's
    ``ApiException`` as it comes.
    """
    if pod_security_level not in POD_SECURITY_LEVELS:
        raise NamespaceSettingsError(f"pod_security_level {pod_security_level!r} is not one "
                                     f"of {', '.join(POD_SECURITY_LEVELS)}.")
    body = make_user_namespace(name=namespace, user_label=user_label,
                               pod_security=pod_security_level)
    try:
        policies = make_user_network_policies(
            namespace=namespace, user_label=user_label, hub_namespace=hub_namespace,
            server_port=server_port, server_component=server_component,
            allowed_egress=allowed_egress, allowed_server_ingress=allowed_server_ingress)
    except ValueError as e:
        raise NamespaceSettingsError(str(e), network=True) from e
    async def apply_namespace() -> bool:
        _, status, _ = await asyncio.wait_for(
            api.patch_namespace_with_http_info(namespace, body, field_manager=FIELD_MANAGER,
                                               force=True, _content_type=APPLY),
            request_timeout)
        return status == 201  # made by this apply: nothing in it is left from before

    created = False

    async def network_policies() -> int:
        # before any pod of the namespace exists, and at every call (put back if edited)
        replaced = await asyncio.wait_for(apply_network_policies(policies, networking),
                                          request_timeout)
        return len(policies) + replaced

    async def service_account() -> int:
        # a new namespace's: there before the pod, so that the API server does not wait for
        # the controller-manager's (`make_default_service_account`)
        await asyncio.wait_for(
            api.patch_namespaced_service_account(
                "default", namespace, make_default_service_account(
                    namespace=namespace, user_label=user_label),
                field_manager=FIELD_MANAGER, force=True, _content_type=APPLY),
            request_timeout)
        return 1

    async def quota() -> int:
        mirror = GPUQuotaMirror.for_loop(ledger, api, sync_interval, log)
        if not gpu_resource_quota:
            # once per namespace and process: a quota left from before Kueue is gone after;
            # none in a namespace this call made (a person's first spawn: one request less)
            if namespace in mirror.cleared:
                return 0
            if created:
                mirror.cleared.add(namespace)
                return 0
            try:
                await asyncio.wait_for(
                    api.delete_namespaced_resource_quota(QUOTA_NAME, namespace),
                    request_timeout)
            except ApiException as e:
                if e.status != 404:
                    raise
            mirror.cleared.add(namespace)
            return 1
        mirror.register(namespace, user, groups, user_label)
        # this person's quota alone (not everyone's), off the loop (the ledger's lock)
        quota, _ = await asyncio.to_thread(ledger.effective, user, groups)
        want = None if quota is None else quota.max_gpus
        if mirror.applied.get(namespace, "unknown") != want:
            await asyncio.wait_for(mirror.apply(namespace, want), request_timeout)
            return 1
        return 0

    prepared = PREPARED.setdefault(api, set())
    if namespace in prepared:
        # a returning person: the namespace is there (this process made or found it), so
        # its objects go with it, one round trip in all
        if namespace_made is not None:
            namespace_made()
        results = await asyncio.gather(apply_namespace(), network_policies(), quota(),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        gone = [e for e in errors if isinstance(e, ApiException) and e.status == 404]
        if not errors and results[0] is False:
            return 1 + sum(results[1:])
        if gone or results[0] is True:
            # deleted meanwhile (by an admin; its objects answered 404, or this apply made
            # it anew: 201): made again as a new one, its objects after it, its GPU quota
            # too (the mirror's record of it went with the namespace), here or at the
            # caller's next try
            prepared.discard(namespace)
            mirror = GPUQuotaMirror.for_loop(ledger, api, sync_interval, log)
            mirror.applied.pop(namespace, None)
            mirror.cleared.discard(namespace)
            log.info("Namespace %s was deleted meanwhile: making it again", namespace)
            if namespace_remade is not None:
                namespace_remade()
        for e in errors:
            if e not in gone:
                raise e
        tried = 1 + len(policies) + (results[2] if isinstance(results[2], int) else 1)
    else:
        tried = 0
    created = await apply_namespace()
    if namespace_made is not None:
        namespace_made()
    # the namespace's objects at once (each needs only the namespace): one round trip's
    # wait instead of one per object (bench/scale_kube.py)
    made = 1 + sum(await asyncio.gather(network_policies(), service_account(), quota()))
    prepared.add(namespace)
    return tried + made
