"""`KubeGPUSpawner`: notebook servers as pods in each user's namespace, on whole GPUs.

It is KubeSpawner configured through its own traits and hooks, plus `GPUSpawnerMixin`:

- each user gets a namespace (``enable_user_namespaces``, ``gpulab-{username}`` as the job
  backend's) labelled for Pod Security ``baseline`` enforcement, with a ResourceQuota on
  ``requests.nvidia.com/gpu`` that mirrors the user's effective gpulab quota (`GPUQuotaMirror`
  keeps it current when an admin edits quotas);
- the namespace's NetworkPolicies are applied at every spawn (server-side apply, so a policy
  deleted or edited by hand is put back): only the hub and the proxy reach the server, and the
  user's pods reach only DNS, the hub, the gpulab service and the operator's ``allowed_egress``
  (the namespace is prepared by `gpulab.hub.cluster.namespaces.prepare_user_namespace`, as
  training jobs' is);
- the GPUs come from the chosen profile of ``profile_list`` and its ``profile_options``
  (KubeSpawner's, applied as KubeSpawner applies them: ``extra_resource_limits``,
  ``node_selector``; override keys are KubeSpawner trait names), plus the GPU toleration;
  a profile's ``allowed_groups`` limits who sees and starts it;
- the shared ReadWriteMany volume is mounted as the user's own sub-path read-write and the
  datasets read-only, next to KubeSpawner's home volume; no service-account token is mounted;
- a pod create that timed out on the hub's side but was made (the next try meets 409) is
  kept, not deleted and made again as KubeSpawner does: each start marks its pod
  (``gpulab.io/start``), and a pod with this start's mark is taken as made;
- a start sees its pod run when the shared pod watch writes it (`WakingPodReflector`), not
  after KubeSpawner's backoff pauses (random, growing to 5 s) between reads of the watch;
- the quota ledger admits the GPUs before the pod is made; a 403 "exceeded quota" from the API
  server becomes the same quota message; the scheduler's reasons reach the progress page in
  plain words.

The Kubernetes objects are built by the pure functions of `gpulab.hub.cluster.kubeobjects`. The
permissions the hub needs are in ``helm-values/rbac.yaml``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import time
import uuid
from functools import partial
from typing import Any

from kubernetes_asyncio.client.rest import ApiException
from kubespawner import KubeSpawner
from kubespawner.clients import load_config, shared_client
from kubespawner.spawner import PodReflector
from traitlets import Unicode, default

from gpulab.hub.quota.ledger import Request
from gpulab.hub.quota.policy import Holding, Quota, never_fits, refusal

from gpulab.hub.cluster.kubeobjects import (
    RUNTIME_DEFAULT_SECCOMP,
    ContainerDefaultsError,
    explain_unschedulable,
    free_gpus_by_node,
    parse_quota_refusal,
    server_pod_settings,
    with_container_defaults,
    with_runtime_default_seccomp,
)
from gpulab.hub.cluster.kueuemirror import KueueMirror
from gpulab.hub.cluster.kueuewatch import PLACE_SECONDS, WorkloadWatch
from gpulab.hub.cluster.kueueobjects import (
    ADMISSION_GATE,
    LOCAL_QUEUE,
    QUEUE_NAME_LABEL,
    ordinal,
    pending_position,
    pending_workloads_path,
    visibility_place,
    workload_wait_reason,
)
from gpulab.hub.cluster.namespaces import (
    USER_NAMESPACE_TEMPLATE,
    GPUQuotaMirror,
    NamespaceSettingsError,
    api_message,
    prepare_user_namespace,
)
from gpulab.hub.cluster.podwatch import WakingPodReflector
from gpulab.hub.cluster.settings import KubeSettings

from .mixin import GPUSpawnerMixin, LedgerView, SpawnRefused, hub_ledger
from .profiles import (
    GPUProfile,
    ProfileError,
    default_profile_list,
    gpu_request,
    parse_profiles,
)

#: traits the spawner sets for each start (from the profile and its own settings)
_MANAGED_TRAITS = ("tolerations", "volumes", "volume_mounts", "environment", "extra_labels")
#: seconds between two looks at a starting pod in a pod watch that wakes nobody (one a stock
#: KubeSpawner of the same process started), and the longest a wait for it sleeps otherwise
POD_LOOK_SECONDS = 0.25
#: seconds between two reads of a queued notebook's Workload (its reason, for the progress
#: page), from the hub's shared watch
KUEUE_PROGRESS_SECONDS = 2.0


class KubeGPUSpawner(GPUSpawnerMixin, KubeSettings, KubeSpawner):
    """Starts each server as a pod in the user's namespace on the GPUs of the chosen profile.

    ``profile_list`` is KubeSpawner's (z2jh ``singleuser.profileList``), with its
    ``profile_options`` (choices, ``unlisted_choice`` with ``validation_regex``, overrides per
    choice, callables) and ``user_options`` of KubeSpawner's shape, from the form or the API.
    The GPUs are ``extra_resource_limits["nvidia.com/gpu"]`` and their model
    ``node_selector["nvidia.com/gpu.product"]`` after all overrides. gpulab adds
    ``allowed_groups`` per profile. Overrides are undone before the next start. As in
    KubeSpawner, ``options_from_form`` only builds ``user_options`` (a typed text its
    ``validation_regex`` refuses is returned as typed) and ``load_user_options`` checks them,
    raising a ValueError (`OptionRefused`, 400) that the form shows. An
    operator's own ``options_form`` / ``options_from_form`` / ``apply_user_options`` are
    used as KubeSpawner would use them.

    Use it with ``c.JupyterHub.spawner_class = "gpulab.spawner.kube.KubeGPUSpawner"``, the
    ledger's pool set with ``c.GPULedger.pool = "kubernetes"``, and the hub's ServiceAccount
    bound by ``helm-values/rbac.yaml``.
    """

    _said_no_visibility = False  # logged once that Kueue's visibility API did not answer
    #: the waiting pod's place as last asked of Kueue: (its namespace's Workloads' versions,
    #: when, the place)
    _kueue_place_asked: tuple | None = None

    gpu_assigns_devices = False

    home_mount_path = Unicode(
        "/home/jovyan",
        help="""Where the user's home volume (KubeSpawner's PVC ``pvc_name``, made when
        ``storage_pvc_ensure``) is mounted; '' to leave volumes to ``volumes`` (default
        ``/home/jovyan``, the Jupyter Docker Stacks' home).""",
    ).tag(config=True)

    @default("enable_user_namespaces")
    def _enable_user_namespaces_default(self):
        return True

    @default("user_namespace_template")
    def _user_namespace_template_default(self):
        # KubeJobBackend's ``namespace_template``: a user's jobs run in their servers' namespace
        return USER_NAMESPACE_TEMPLATE

    @default("automount_service_account_token")
    def _automount_default(self):
        return False

    @default("storage_pvc_ensure")
    def _storage_pvc_ensure_default(self):
        return True

    @default("storage_capacity")
    def _storage_capacity_default(self):
        return "10Gi"

    @default("options_form")
    def _gpu_options_form_default(self):
        # rendered at every visit of the spawn page (KubeSpawner's own renders a static
        # profile_list once), so that the quota and what each profile could get are of now
        if not self.profile_list:
            return ""
        return self._gpu_form

    @default("options_from_form")
    def _gpu_options_from_form_default(self):
        return self._gpu_options_from_form

    def _base_options_from_form(self, formdata):
        return KubeSpawner._options_from_form(self, formdata)

    async def _resolve_profile_list(self) -> list:
        configured = self._sorted_dict_values(self.profile_list)
        if callable(configured):
            configured = await _maybe_await(configured(self))
        if isinstance(configured, dict):
            configured = self._sorted_dict_values(configured)
        return list(configured or [])

    async def _gpu_form(self, spawner) -> str:
        """The user's GPU quota and holdings, then the profiles this user may use with their
        options, each disabled with the reason where it could not start now. With
        ``profile_form_template`` or ``additional_profile_form_template_paths`` set, that is
        KubeSpawner's form of those profiles instead."""
        self._gpu_profile_list = await self._resolve_profile_list()
        if self.profile_form_template or self.additional_profile_form_template_paths:
            visible = {p.slug for p in self.gpu_visible_profiles()}
            raw = [e for e, p in zip(self._gpu_profile_list, self.gpu_profiles())
                   if p.slug in visible]
            return await self.render_quota_summary() + self._render_options_form(raw)
        return await self.render_quota_summary() + await self.render_gpu_form()

    @default("apply_user_options")
    def _apply_user_options_default(self):
        # user_options are validated and applied in load_user_options(), as KubeSpawner does
        return self._gpu_apply_user_options

    # -- profiles and settings ------------------------------------------------------------

    _gpu_profile_list: list | None = None
    gpu_profile: GPUProfile | None = None

    def gpu_profiles(self) -> list[GPUProfile]:
        configured = self._gpu_profile_list
        if configured is None:  # not resolved by load_user_options yet (the spawn form)
            configured = self._sorted_dict_values(self.profile_list)
            if callable(configured):
                raise ProfileError("A callable profile_list is resolved when the server starts.")
        return parse_profiles(list(configured) or default_profile_list(0))

    @property
    def gpu_inventory(self):
        return []  # the cluster's GPUs are on its nodes, not on the hub's machine

    @property
    def user_label(self) -> str:
        """The user's safe name, a valid label value."""
        return self._expand_user_properties("{safe_username}")

    def _server_settings(self, profile: GPUProfile) -> dict[str, Any]:
        home = None
        if self.storage_pvc_ensure and self.home_mount_path:
            home = {"claim": self.pvc_name, "mount": self.home_mount_path}
        return server_pod_settings(
            gpus=profile.gpus,
            tolerations=self.tolerations,
            volumes=self.volumes,
            volume_mounts=self.volume_mounts,
            environment=self.environment,
            home=home,
            shared_volume=self.shared_volume,
            shared_mount=self.shared_mount_path,
            user_subpath=self._expand_user_properties(self.user_subpath_template),
            datasets_subpath=self.datasets_subpath or None,
        )

    async def load_user_options(self):
        """Validate ``user_options``, apply the profile and its options' overrides (in
        KubeSpawner's order, through its `_apply_overrides`), count the GPUs of the result,
        then admit them (or refuse)."""
        self._gpu_profile_list = await self._resolve_profile_list()
        selection = self.gpu_selection()  # SpawnRefused(400) for bad options
        self.gpu_undo_overrides()
        before = self.gpu_traits_before({*_MANAGED_TRAITS, *selection.override_keys,
                                         "extra_resource_limits", "node_selector"})
        try:
            for override in selection.overrides:
                self._apply_overrides(copy.deepcopy(override))
            gpus, model = gpu_request({"extra_resource_limits": self.extra_resource_limits,
                                       "node_selector": self.node_selector},
                                      f"profile '{selection.profile.display_name}'")
        except (ValueError, TypeError) as e:  # a TraitError, a bad count from a choice
            for name, value in before.items():
                setattr(self, name, value)
            raise SpawnRefused(400, f"Profile '{selection.profile.display_name}' cannot start "
                               f"with the options chosen: {e}") from e
        profile = dataclasses.replace(selection.profile, gpus=gpus, model=model)
        for name, value in self._server_settings(profile).items():
            setattr(self, name, value)
        if self.kueue and profile.gpus:  # Kueue admits the pod (its pod integration)
            self.extra_labels = {**self.extra_labels, QUEUE_NAME_LABEL: LOCAL_QUEUE}
        self.gpu_record_overrides(before)
        self.gpu_profile = profile
        await self.admit_gpus(profile)  # SpawnRefused(409) when the quota is used up

    # -- namespace and quota ---------------------------------------------------------------

    @property
    def quota_mirror(self) -> GPUQuotaMirror:
        return GPUQuotaMirror.for_loop(self.gpu_ledger, self.api, self.gpu_quota_sync_interval,
                                       self.log)

    # -- Kueue (``kueue``): the pod waits in the person's queue ----------------------------

    async def admit_gpus(self, profile: GPUProfile):
        """Without Kueue: the ledger admits the GPUs now (the mixin's). With Kueue: nothing is
        held yet (Kueue admits the pod; `_finish_start` records its GPUs), but a server
        asking more GPUs than the person's quota is refused at once: it could never start."""
        if not self.kueue or not profile.gpus:
            return await super().admit_gpus(profile)
        if self.gpu_claim_id:
            await self.release_gpus_async()
        ledger = await asyncio.to_thread(hub_ledger, self.config, self.gpu_assigns_devices)
        quota, source = await asyncio.to_thread(ledger.effective, self.user.name,
                                                self.user_groups)
        never = never_fits(quota, profile.gpus)
        if never is not None:
            raise SpawnRefused(409, f"Cannot start with profile '{profile.display_name}'. "
                               + never.message(source))
        return ()

    def kueue_mirror(self, ledger) -> KueueMirror:
        load_config()
        return KueueMirror.for_loop(
            ledger, shared_client("CustomObjectsApi"), self.api,
            interval=self.gpu_quota_sync_interval, log=self.log,
            request_timeout=self.k8s_api_request_timeout, pool=self.kueue_gpus,
            by_model=self.kueue_gpu_models, preemptible=False)

    async def _kueue_record_gpus(self) -> None:
        """The pod runs: Kueue admitted it. Its GPUs in the ledger (as any server's)."""
        ledger = await asyncio.to_thread(hub_ledger, self.config, self.gpu_assigns_devices)
        profile = self.gpu_profile
        allocation = await asyncio.to_thread(ledger.adopt, Request(
            user=self.user.name, kind="notebook", holder=self.gpu_holder_name,
            gpus=profile.gpus, groups=self.user_groups, model=profile.model))
        self._adopt(allocation, probe=None)

    async def _kueue_wait_words(self, watch: WorkloadWatch | None = None) -> str | None:
        """Why this server's gated pod waits, from its Workload (None: not gated): from the
        hub's shared Workload watch where it runs, else from a list of the namespace's
        Workloads. Its place is asked of Kueue when the namespace's Workloads changed or
        `PLACE_SECONDS` passed (`gpulab.hub.cluster.kueuewatch`)."""
        pod = (self.pod_reflector.pods.get(f"{self.namespace}/{self.pod_name}")
               if self.pod_reflector else None)
        if pod is None or not any(g.get("name") == ADMISSION_GATE
                                  for g in pod["spec"].get("schedulingGates") or []):
            return None
        workloads = watch.in_namespace(self.namespace) if watch is not None else None
        if workloads is None:
            try:
                workloads = await self._list_json(
                    partial(shared_client("CustomObjectsApi").list_namespaced_custom_object,
                            "kueue.x-k8s.io", "v1beta2", self.namespace, "workloads"))
            except (ApiException, asyncio.TimeoutError) as e:
                self.log.info("Cannot read why %s waits: %s", self._log_name, e)
                return None
        uid = pod["metadata"].get("uid")
        mine = next((w for w in workloads if any(
            o.get("uid") == uid for o in w["metadata"].get("ownerReferences") or [])), None)
        seen = (WorkloadWatch.version(workloads), uid)
        asked = self._kueue_place_asked
        if (asked is not None and asked[0] == seen
                and time.monotonic() - asked[1] < PLACE_SECONDS):
            place = asked[2]
        else:
            place = await self._queue_place(workloads, mine)
            self._kueue_place_asked = (seen, time.monotonic(), place)
        where = ("" if place is None else " (next in line)" if place == 1
                 else f" ({ordinal(place)} in line)")
        return f"Waiting for GPUs in your queue{where}: " + workload_wait_reason(mine)

    async def _queue_place(self, workloads: list[dict], mine: dict | None) -> int | None:
        """Where the server's Workload stands in its LocalQueue (1 is next): Kueue's own
        answer from its visibility API, else (an API server without it, or no permission)
        worked out from the namespace's Workloads as Kueue orders them."""
        queue = (mine or {}).get("spec", {}).get("queueName")
        if mine is None or not queue:
            return None
        client = shared_client("CustomObjectsApi").api_client
        try:
            resp = await asyncio.wait_for(client.call_api(
                pending_workloads_path(self.namespace, queue), "GET",
                header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
                _preload_content=False, _return_http_data_only=True), self.k8s_api_request_timeout)
            pending = json.loads(await resp.read()).get("items") or []
        except (ApiException, asyncio.TimeoutError, ValueError) as e:
            if not self._said_no_visibility:
                self._said_no_visibility = True
                self.log.info("Kueue's visibility API did not answer for %s (%s): its place in "
                              "the queue is worked out from the Workloads", self._log_name,
                              getattr(e, "status", None) or type(e).__name__)
            return pending_position(workloads, mine)
        return visibility_place(pending, mine["metadata"]["name"])

    async def _ensure_namespace(self):
        """Create or update the user's namespace (Pod Security labels), then its
        NetworkPolicies and quota (`prepare_user_namespace`, as the job backend does); with
        Kueue, the person's Kueue objects (`gpulab.hub.cluster.kueuemirror`). Every request
        is idempotent (server-side apply; a DELETE that finds nothing is fine): one that
        times out (``k8s_api_request_timeout``) or that a busy API server turns away (429,
        5xx) is sent again, for up to ``k8s_api_request_retry_timeout`` seconds, as
        KubeSpawner retries the pod's creation (bench/scale_kube.py: in a storm of 500 spawns
        a slow answer failed a spawn at once)."""
        # opened by admit_gpus already; the first call would migrate, so not on the loop
        ledger = await asyncio.to_thread(hub_ledger, self.config, self.gpu_assigns_devices)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.k8s_api_request_retry_timeout
        wait = 0.2
        while True:
            try:
                return await self._prepare_namespace(ledger)
            except (asyncio.TimeoutError, ApiException) as e:
                status = getattr(e, "status", None)
                if isinstance(e, ApiException) and not (status == 429 or (status or 0) >= 500):
                    raise
                if loop.time() + wait > deadline:
                    raise
                self.log.warning("Preparing namespace %s for %s: %s; trying again in %.1fs",
                                 self.namespace, self._log_name,
                                 status or "no answer in time", wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, 5.0)

    async def _prepare_namespace(self, ledger) -> None:
        # with Kueue, the person's queues (the first spawn in this process) go while the
        # namespace is made, their LocalQueue with the namespace's objects: one round trip
        # to the API server less before the pod (bench/scale_kube.py)
        self._checked_container_defaults()  # before any request
        made, remade = asyncio.Event(), []
        queues = None
        if self.kueue:
            mirror = self.kueue_mirror(ledger)
            if (self.namespace not in mirror.applied
                    or mirror.users[self.namespace][1] != tuple(self.user_groups)):
                queues = asyncio.ensure_future(mirror.register(
                    self.namespace, self.user.name, tuple(self.user_groups), self.user_label,
                    namespace_ready=made.wait))
        try:
            await prepare_user_namespace(
                api=self.api, ledger=ledger, namespace=self.namespace, user=self.user.name,
                groups=self.user_groups, user_label=self.user_label,
                pod_security_level=self.pod_security_level, hub_namespace=self.hub_namespace,
                allowed_egress=self.allowed_egress,
                allowed_server_ingress=self.allowed_server_ingress,
                sync_interval=self.gpu_quota_sync_interval,
                request_timeout=self.k8s_api_request_timeout, log=self.log,
                server_port=self.port, server_component=self.component_label,
                gpu_resource_quota=not self.kueue,
                namespace_made=made.set, namespace_remade=lambda: remade.append(True))
        except BaseException as e:
            if queues is not None:  # (waiting for a namespace that is not coming)
                queues.cancel()
                await asyncio.gather(queues, return_exceptions=True)
            if isinstance(e, NamespaceSettingsError):
                raise SpawnRefused(500, f"The server's network settings are wrong: {e}"
                                   if e.network else str(e)) from e
            raise
        if queues is not None:
            await queues
        elif remade and self.kueue:  # deleted meanwhile: its LocalQueues went with it
            mirror.applied.pop(self.namespace, None)
            await mirror.register(self.namespace, self.user.name, tuple(self.user_groups),
                                  self.user_label)

    async def get_pod_manifest(self):
        """KubeSpawner's pod, run under the container runtime's default seccomp filter
        (``RuntimeDefault``) unless the pod's security context names a profile
        (``pod_security_context``); a container's own profile (``container_security_context``)
        still wins, and ``modify_pod_hook`` runs after this, as in KubeSpawner."""
        pod = await super().get_pod_manifest()
        context = pod.spec.security_context
        if context is None or isinstance(context, dict):
            pod.spec.security_context = with_runtime_default_seccomp(context)
        elif getattr(context, "seccomp_profile", None) is None:  # a client model object
            context.seccomp_profile = dict(RUNTIME_DEFAULT_SECCOMP)
        return pod

    async def _make_create_pod_request(self, pod, request_timeout):
        # KubeSpawner answers a 409 (the pod is there already) with `stop(True)` and a new
        # create. Most often the pod in the way is this start's own: its create timed out on
        # this side under load, and the API server made it all the same. Deleting it then
        # races the next create: a DELETE that timed out here too can land after the new pod
        # is made and remove it (a spawn of 500 waited `start_timeout` so, bench/scale_kube.py).
        # So each start marks its pod (`START_ANNOTATION`, set here: the manifest stays
        # KubeSpawner's), and `stop` keeps a pod with this start's mark: the next try takes
        # it as made. A pod of an earlier start is still deleted, as KubeSpawner does; the
        # start goes on, so the GPUs admitted for it stay held (`stop`).
        self._fill_container_defaults(pod)
        start = self._mark_start(pod)
        if start is not None and getattr(self, "_own_pod", None) == start:
            self.log.info("Pod %s/%s is this start's own (its create answered late): kept",
                          self.namespace, self.pod_name)
            return True
        self._recreating_pod = start or True
        try:
            return await super()._make_create_pod_request(pod, request_timeout)
        except ApiException as e:
            message = api_message(e)
            if ((e.status == 403 and ("status unknown for quota" in message
                                      or "error looking up service account" in message))
                    or (e.status == 404 and "admission webhook" in message
                        and f'Namespace "{self.namespace}" not found' in message)):
                # a new ResourceQuota is not counted yet by the quota controller, a new
                # namespace's default ServiceAccount not made yet by its controller (stock
                # KubeSpawner fails such a spawn: 154 of 500 first spawns in a storm,
                # bench/scale_kube.py), or a webhook's cache (Kueue's) has not seen the new
                # namespace yet: retry (within k8s_api_request_retry_timeout)
                return False
            raise
        finally:
            self._recreating_pod = False

    def _checked_container_defaults(self) -> tuple[dict[str, str], dict[str, str]]:
        try:
            return self.container_defaults()
        except ValueError as e:
            raise SpawnRefused(500, f"The servers' container defaults are wrong: {e}") from e

    def _fill_container_defaults(self, pod) -> None:
        """The operator's container defaults (``default_container_limits`` /
        ``default_container_requests``) into each container of ``pod`` that names none of
        its own, init containers too, after ``modify_pod_hook`` (its containers may be the
        client's model objects or dicts; idempotent: each create try sends the same pod)."""
        limits, requests = self._checked_container_defaults()
        spec = getattr(pod, "spec", None)
        if isinstance(spec, dict):  # a hook's
            containers = [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
        elif spec is not None:
            containers = [*(spec.containers or []), *(spec.init_containers or [])]
        else:  # no pod the API server takes: it says so
            return
        for c in containers:
            name = c.get("name") if isinstance(c, dict) else c.name
            own = c.get("resources") if isinstance(c, dict) else c.resources
            try:
                if own is None or isinstance(own, dict):
                    filled = with_container_defaults(own, limits=limits, requests=requests)
                    if isinstance(c, dict):
                        c["resources"] = filled
                    else:
                        c.resources = filled
                else:  # V1ResourceRequirements
                    filled = with_container_defaults(
                        {"limits": own.limits, "requests": own.requests},
                        limits=limits, requests=requests)
                    own.limits, own.requests = filled.get("limits"), filled.get("requests")
            except ContainerDefaultsError as e:
                raise SpawnRefused(400, f"This server's container {name!r} asks for {e}: the "
                                        "cluster would refuse its pod. Choose less, or ask an "
                                        "admin for a profile that sets a limit too.") from e

    def _mark_start(self, pod) -> str | None:
        """This start's mark on its pod: made at the first create try (a new pod object),
        kept by the next ones (they send the same object); None for a pod without object
        metadata (a hook's own type)."""
        meta = getattr(pod, "metadata", None)
        if meta is None or isinstance(meta, dict) or not hasattr(meta, "annotations"):
            return None
        last = getattr(self, "_start_mark", None)
        if last is None or last[0] is not pod:
            # a new start: a fresh mark, over any the manifest had (extra_annotations)
            last = self._start_mark = (pod, uuid.uuid4().hex)
            self._own_pod = None
        meta.annotations = {**(meta.annotations or {}), START_ANNOTATION: last[1]}
        return last[1]

    async def _pod_in_the_way(self, start: str) -> str:
        """Whose is the pod a create met with 409: ``"own"`` (this start's mark, not being
        deleted), ``"other"``, ``"gone"`` (404 now) or ``"unknown"`` (not read in time)."""
        try:
            pod = await asyncio.wait_for(
                self.api.read_namespaced_pod(self.pod_name, self.namespace),
                self.k8s_api_request_timeout)
        except asyncio.TimeoutError:
            return "unknown"
        except ApiException as e:  # (a busy API server's 429 or 5xx: try the create again)
            return "gone" if e.status == 404 else "unknown"
        meta = pod.metadata
        if (meta.deletion_timestamp is None
                and (meta.annotations or {}).get(START_ANNOTATION) == start):
            return "own"
        return "other"

    # -- waiting for the pod -------------------------------------------------------------

    async def _start_reflector(self, kind, reflector_class, replace=False, **kwargs):
        # KubeSpawner's shared pod watch, as KubeSpawner selects it, with a store that wakes
        # a start waiting for its pod (`is_pod_running`)
        if reflector_class is PodReflector:
            reflector_class = WakingPodReflector
            running = self.__class__.reflectors.get(self._get_reflector_key(kind))
            if running is not None and not isinstance(running, WakingPodReflector):
                # a stock KubeSpawner's of this process (same selection): replaced by one
                # that wakes, which its spawners then read too
                replace = True
        return await super()._start_reflector(kind, reflector_class, replace=replace, **kwargs)

    def is_pod_running(self, pod):
        """KubeSpawner's answer, except in a start's own wait for its pod: there a pod not
        running yet gives an awaitable that answers once it runs, or at ``start_timeout``.

        KubeSpawner's start reads its pod watch with JupyterHub's ``exponential_backoff``,
        whose pauses grow to 5 s at random; a pod that runs a few seconds after its creation
        (Kueue admits it) was seen running up to 5 s late. The backoff awaits what its test
        returns, so the wait is the watch's: woken by each change of the pod
        (`WakingPodReflector`), re-read every `POD_LOOK_SECONDS` where the watch wakes
        nobody. Any other caller (``poll``, an operator's) gets KubeSpawner's bool; the
        awaitable itself is false (an operator's hook that runs in the start and tests it
        reads "not running"), and waits only when awaited."""
        running = super().is_pod_running(pod)
        if running or not self._in_start_wait():
            return running
        return _RunningSoon(self._pod_runs)

    def _in_start_wait(self) -> bool:
        start = getattr(self, "_start_future", None)
        if start is None or start.done():
            return False
        try:
            return asyncio.current_task() is start
        except RuntimeError:  # no running event loop: a synchronous caller
            return False

    async def _pod_runs(self) -> bool:
        loop = asyncio.get_running_loop()
        deadline = getattr(self, "_pod_wait_deadline", None)
        if deadline is None:
            # one deadline per start (`_finish_start` clears it): a second call of the
            # backoff's (after this one said False at ``start_timeout``) gives up at once, as
            # its own deadline is near
            deadline = self._pod_wait_deadline = loop.time() + self.start_timeout
        key = f"{self.namespace}/{self.pod_name}"
        while True:
            reflector = self.pod_reflector
            if super().is_pod_running(reflector.pods.get(key)):
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            if isinstance(reflector, WakingPodReflector):
                # re-read after a while all the same: a watch replaced meanwhile (KubeSpawner
                # restarts one that failed) wakes nobody
                await reflector.changed(key, min(left, 1.0))
            else:
                await asyncio.sleep(min(left, POD_LOOK_SECONDS))

    # -- start, and what the person reads ------------------------------------------------

    async def delete_forever(self):
        """KubeSpawner's (the PVC, where ``delete_pvc``); then, with Kueue, for the default
        server (JupyterHub calls this for it only when the person's account is deleted: it
        refuses to remove a default server otherwise), the person's ClusterQueues and
        LocalQueues (`KueueMirror.remove`: what waits in them is never admitted; what runs
        finishes), even where KubeSpawner's part failed. Their namespace and the shared
        storage stay. An API error is logged (JupyterHub deletes the account anyway): an admin
        can delete the queues as the deploy guide says."""
        try:
            await super().delete_forever()
        finally:
            if self.kueue and not self.name:
                ledger = await asyncio.to_thread(hub_ledger, self.config, self.gpu_assigns_devices)
                try:
                    await self.kueue_mirror(ledger).remove(self.namespace)
                except ApiException as e:
                    self.log.warning("Could not delete the Kueue queues of %s (namespace %s): "
                                     "%s %s", self.user.name, self.namespace, e.status,
                                     api_message(e))

    async def stop(self, now=False):
        start = getattr(self, "_recreating_pod", False)
        if now and isinstance(start, str):
            # KubeSpawner's answer to a 409 on this start's create (`_make_create_pod_request`)
            whose = await self._pod_in_the_way(start)
            if whose == "own":
                self._own_pod = start  # the next try takes it as made
                return
            if whose != "other":  # gone already, or not read in time: try the create again
                return
        await super().stop(now=now)
        if now and start:
            # KubeSpawner removing a pod in the way of the one this start creates (its
            # ``stop(True)``): the start goes on, and its pod holds the GPUs admitted for it
            # (released, they would be used by the new pod and admitted to someone else too).
            # A stop asked meanwhile (JupyterHub's, not `now`) releases; so does clear_state.
            return
        # the pod is gone: its GPUs go back (off the event loop; clear_state, which JupyterHub
        # calls next, then has nothing left to release)
        await self.release_gpus_async()

    def start(self):
        inner = super().start()  # KubeSpawner keeps this future for progress()
        return asyncio.ensure_future(self._finish_start(inner))

    async def _finish_start(self, inner):
        try:
            try:
                url = await inner
            finally:
                self._pod_wait_deadline = None  # (the next start's wait has its own)
        except ApiException as e:
            await self.release_gpus_async("server did not start")
            raise await self._translate(e) from e
        except BaseException:
            await self.release_gpus_async("server did not start")
            raise
        if self.kueue and self.gpu_profile is not None and self.gpu_profile.gpus:
            try:
                await self._kueue_record_gpus()
            except BaseException:
                await self._kueue_stop_quietly()
                raise
        self.set_gpu_probe()
        self.log.info("Started %s as pod %s/%s (profile %s, %d GPU(s))", self._log_name,
                      self.namespace, self.pod_name,
                      self.gpu_profile.slug if self.gpu_profile else "?",
                      self.gpu_profile.gpus if self.gpu_profile else 0)
        return url

    async def _translate(self, e: ApiException) -> Exception:
        """A refusal by the API server as a message for the person (else ``e`` itself)."""
        message = api_message(e)
        numbers = parse_quota_refusal(message) if e.status == 403 else None
        if numbers:
            # the user's quota and holdings, read in a worker thread (never on the loop)
            view = await self.gpu_ledger_view(mine_only=True)
            return SpawnRefused(403, self.quota_message(view, **numbers))
        if e.status == 403 and "violates PodSecurity" in message:
            return SpawnRefused(403, "The cluster refused this server's pod because it breaks "
                                f"the namespace's security policy: {message}")
        return e

    def quota_message(self, view: LedgerView, *, requested: int, used: int,
                      limited: int) -> str:
        """The ledger's quota message for a refusal by the namespace's ResourceQuota, from
        ``view`` (`gpu_ledger_view` with ``mine_only``: this user's quota and allocations;
        no ledger read here)."""
        quota, source = view.quota, view.source
        if quota is None or quota.max_gpus != limited:
            source = "your namespace's ResourceQuota"
        holdings = [Holding(a.kind, a.holder, a.gpus) for a in view.allocations
                    if a.user == self.user.name and a.gpus]
        other = used - sum(h.gpus for h in holdings)
        if other > 0:
            holdings.append(Holding("other pods in namespace", self.namespace, other))
        why = refusal(Quota(max_gpus=limited), source, requested, holdings)
        return why or (f"Quota exceeded: the cluster allows {limited} GPUs in namespace "
                       f"{self.namespace}, {used} are in use and this server needs {requested}.")

    async def _kueue_stop_quietly(self) -> None:
        try:
            await super().stop(now=True)
        except Exception as e:  # noqa: BLE001 - the start fails with the first error
            self.log.warning("Could not remove the pod of %s: %s", self._log_name, e)

    async def progress(self):
        """KubeSpawner's progress, with the scheduler's reasons in plain words; with Kueue,
        while the pod waits in the queue, why it waits (read every `KUEUE_PROGRESS_SECONDS`
        from the hub's one shared watch over Kueue's Workloads, `WorkloadWatch`, which runs
        while some server's progress needs it; an event when it changes)."""
        events = self._explained_progress()
        if not self.kueue:
            async for event in events:
                yield event
            return
        pending = asyncio.ensure_future(events.__anext__())
        said = None
        watch = None
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=KUEUE_PROGRESS_SECONDS)
                if pending in done:
                    try:
                        event = pending.result()
                    except StopAsyncIteration:
                        return
                    yield event
                    pending = asyncio.ensure_future(events.__anext__())
                    continue
                if watch is None:  # once the pod waits longer than a moment
                    shared = WorkloadWatch.shared()
                    watch = shared if await shared.acquire(self) else False
                    if watch is False:
                        shared.release()
                words = await self._kueue_wait_words(watch or None)
                if words and words != said:
                    said = words
                    yield {"progress": 50, "message": words}
        finally:
            if watch:
                watch.release()
            pending.cancel()
            # the generator runs until the cancelled step has ended: only then can it close
            await asyncio.gather(pending, return_exceptions=True)
            await events.aclose()

    async def _explained_progress(self):
        explained: dict[str, str | None] = {}
        async for event in super().progress():
            raw = event.get("raw_event")
            if raw and raw.get("reason") == "FailedScheduling" and self.gpu_profile is not None:
                text = raw.get("message") or ""
                if text not in explained:
                    explained[text] = await self._explain_unschedulable(text)
                if explained[text]:
                    event = {**event, "message": explained[text]}
            yield event

    async def _explain_unschedulable(self, message: str) -> str | None:
        profile = self.gpu_profile
        free: dict[str, int] = {}
        if profile.gpus:
            try:
                nodes = await self._list_json(self.api.list_node)
                pods = await self._list_json(
                    self.api.list_pod_for_all_namespaces,
                    field_selector="spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed")
            except (ApiException, asyncio.TimeoutError) as e:
                self.log.warning("Cannot explain why %s waits: %s", self._log_name, e)
                return None
            free = free_gpus_by_node(nodes=nodes, pods=pods, model=profile.model)
        return explain_unschedulable(message, gpus=profile.gpus, model=profile.model,
                                     free_by_node=free)

    async def _list_json(self, method, **kwargs) -> list[dict]:
        resp = await asyncio.wait_for(method(_preload_content=False, **kwargs),
                                      self.k8s_api_request_timeout)
        return json.loads(await resp.read())["items"]

    # -- liveness and state ----------------------------------------------------------------

    def gpu_probe(self):
        key = f"{self.namespace}/{self.pod_name}"

        def alive() -> bool:
            ref = self.pod_reflector
            if ref is None or not ref.first_load_future.done():
                return True  # cannot tell yet: keep the GPUs
            return key in ref.pods

        return alive

    def load_state(self, state):
        # synchronous, as JupyterHub calls it (User._new_spawner, when it makes the spawner):
        # the mixin's read of the server's allocation stays here, and registering with the
        # mirror reads nothing (its syncs read the ledger in a worker thread)
        super().load_state(state)
        # a server that runs since before a hub restart: keep its quota mirrored
        if state and state.get("pod_name") and self.enable_user_namespaces:
            try:
                self.quota_mirror.register(self.namespace, self.user.name, self.user_groups,
                                           self.user_label)
            except RuntimeError:  # no running loop (a hub that restores state synchronously)
                pass


class _RunningSoon:
    """`KubeGPUSpawner.is_pod_running`'s answer in a start's wait: false as a bool (the pod
    does not run yet), and, awaited (as JupyterHub's ``exponential_backoff`` awaits what its
    test returns), whether the pod ran before ``start_timeout``."""

    __slots__ = ("_wait",)

    def __init__(self, wait):
        self._wait = wait

    def __bool__(self) -> bool:
        return False

    def __await__(self):
        return self._wait().__await__()


async def _maybe_await(value):
    if asyncio.isfuture(value) or asyncio.iscoroutine(value):
        return await value
    return value


START_ANNOTATION = "gpulab.io/start"


__all__ = ["KubeGPUSpawner"]
