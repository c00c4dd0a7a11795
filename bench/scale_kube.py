"""gpulab at organisation scale on Kubernetes: KubeGPUSpawner with Kueue against stock KubeSpawner,
without Kueue and with it.

The Kubernetes half of issue 40 (`bench/scale.py --kube` runs this: ``main(argv)``, the
arguments below; ``parse``, ``bench`` and ``report`` for a caller of its own). Everything runs in this
process against one real control plane of the cluster tier (tests/cluster: etcd,
kube-apiserver, scheduler, controller-manager, kwok playing the kubelets of fake GPU nodes,
Kueue v0.17 and JobSet), as the hub's ServiceAccount bound by helm-values/rbac.yaml:

1. a ledger (SQLite) with ``--users`` people, each with their own quota (2 GPUs at once and a
   weekly GPU-hour budget, as an organisation sets them), so that every read of the quotas
   reads them all;
2. for each configuration in turn (stock KubeSpawner; stock KubeSpawner under Kueue as an
   operator of z2jh would run it; then KubeGPUSpawner with ``c.KubeGPUSpawner.kueue``: the
   pod waits in the person's Kueue queue and is admitted by Kueue), a storm of ``--servers``
   spawns, ``--concurrency`` at once, each a new person (with user namespaces, a new
   namespace), 1 GPU each (the same profile; the stock spawner adds the GPU toleration
   itself, as an admin would); then ``--rest`` seconds at rest with all those servers
   running; then all are stopped (the spawners' shared watches, reflectors, run on: the
   requests at rest of a configuration include those of the ones before it; stock-kueue's
   watch its one namespace, 12/min at 500 pods. Two runs that stopped them between configurations had 2
   of 500 gpulab spawns hang each (one run without it: none), cause not found, so they are
   not stopped);
3. it prints, per configuration: p50/p99 spawn time (start() to the server's address), failed
   starts, API requests per spawn (the Kubernetes client's own requests, counted per spawn
   through a context variable; watches are counted apart), which requests they were, and at
   rest the requests per minute (the reflectors' watches, gpulab's quota and Kueue mirrors) and
   the CPU this process used, with the Kueue mirror's pass time; where each spawn's time went
   after its pod was made (the API server's timestamps: Kueue's Workload, its admission, the
   scheduler's placement, kwok's Ready, the spawner seeing it run); and the requests of the
   spawns' progress streams, read as each person's spawn-pending page would, until the
   start ends, as JupyterHub's progress handler reads them (``--no-progress``: not read; a
   spawn's time never waits for its stream). Then the
   ratios against the goals of issue 40 (p99 <= 1.2x stock's, requests per spawn <= stock + 3),
   against each stock baseline that ran.
   ``--configs stock,gpulab,gpulab-poll`` adds KubeGPUSpawner with each progress stream
   listing its Workloads every 2 s, as before the hub's shared Workload watch.

    python -m bench.scale_kube                       # quick: 200 people, 40 servers
    python -m bench.scale_kube --users 2000 --servers 1000 --concurrency 50 --rest 60

The two stock baselines: ``stock`` has no Kueue (its pods go to the scheduler at once) and a
namespace per person (``enable_user_namespaces``, as gpulab's); ``stock-kueue`` is stock
KubeSpawner as an operator would run it under Kueue in a z2jh deployment: every server pod in
one namespace (`Z2JH_NAMESPACE`, z2jh's default: no namespace per person), labelled
``kueue.x-k8s.io/queue-name: <Z2JH_QUEUE>`` by ``c.KubeSpawner.extra_labels``, a LocalQueue of
one ClusterQueue with GPUs for every pod (made once, before the runs, with the admin's
credentials), so that its pods pay Kueue's admission (a scheduling gate Kueue lifts) as
gpulab's do.
A first spawn of a person also makes their namespace's objects and, with Kueue, their queues;
``--respawns`` more spawns of people who ran a server before measure a returning person.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests.cluster.hubrbac import hub_rbac_docs  # noqa: E402
from tests.cluster.controlplane import (  # noqa: E402
    BUILD_SCRIPT,
    GPU_TOLERATION,
    ControlPlane,
    fake_node,
)

PROFILE = [{
    "display_name": "1 H100", "slug": "h100-1", "default": True,
    "kubespawner_override": {
        "extra_resource_limits": {"nvidia.com/gpu": "1"},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
        "cpu_guarantee": 0.01, "mem_guarantee": "16M",
    },
}]
GPUS_PER_NODE = 100  # kwok nodes: 100 GPUs and 110 pods each
#: the ``stock-kueue`` baseline: the namespace of every server pod (z2jh's release namespace)
#: and its LocalQueue, of the ClusterQueue `Z2JH_QUEUE` (`z2jh_queue`)
Z2JH_NAMESPACE = "jhub"
Z2JH_QUEUE = "jhub-users"
QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"
NAMES = {"stock": "stock KubeSpawner (no Kueue, a namespace per person)",
         "stock-kueue": "stock KubeSpawner + Kueue (z2jh: one namespace, one LocalQueue)",
         "gpulab": "KubeGPUSpawner + Kueue",
         "gpulab-nokueue": "KubeGPUSpawner without Kueue",
         "gpulab-poll": "KubeGPUSpawner + Kueue, progress polling each Workload list "
                        "(before the shared watch)"}
#: a letter per configuration for the names of its people where ``--users`` is too few
LETTER = {"stock": "s", "stock-kueue": "z", "gpulab": "g", "gpulab-nokueue": "n", "gpulab-poll": "p"}

#: which spawn (or phase) the current task works for; tasks inherit it
WHO: contextvars.ContextVar[str | None] = contextvars.ContextVar("who", default=None)


def _shape(method: str, url: str) -> str:
    """``PATCH /api/v1/namespaces/*/networkpolicies/*`` from a request's method and URL."""
    path = re.sub(r"^https?://[^/]+", "", url).split("?")[0]
    path = re.sub(r"/namespaces/[^/]+", "/namespaces/*", path)
    parts = path.split("/")
    # a name after a plural (the object's own): *
    out = []
    for i, p in enumerate(parts):
        out.append("*" if i and parts[i - 1] in NAMED and i == len(parts) - 1 else p)
    return f"{method} {'/'.join(out)}"


NAMED = {"pods", "networkpolicies", "limitranges", "resourcequotas", "namespaces",
         "clusterqueues", "localqueues", "cohorts", "resourceflavors",
         "workloadpriorityclasses", "persistentvolumeclaims"}


class RequestCounter:
    """Counts the Kubernetes client's requests (kubernetes_asyncio's REST client), by `WHO`
    and by shape; watches apart."""

    def __init__(self):
        from kubernetes_asyncio.client import rest

        self.by_who: collections.Counter[str | None] = collections.Counter()
        self.shapes: dict[str | None, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.watches = 0
        self.total = 0
        #: configuration -> shape -> [(seconds, HTTP status or exception's name)]
        self.answers: dict[str, dict[str, list]] = collections.defaultdict(
            lambda: collections.defaultdict(list))
        original = rest.RESTClientObject.request
        counter = self

        async def counted(self, method, url, query_params=None, *args, **kwargs):
            if any(k == "watch" and str(v).lower() == "true" for k, v in (query_params or [])):
                counter.watches += 1
                return await original(self, method, url, query_params, *args, **kwargs)
            who = WHO.get()
            shape = _shape(method, url)
            counter.total += 1
            counter.by_who[who] += 1
            counter.shapes[who][shape] += 1
            t0, status = time.perf_counter(), None
            try:
                answer = await original(self, method, url, query_params, *args, **kwargs)
                status = getattr(answer, "status", 200)
                return answer
            except BaseException as e:
                status = getattr(e, "status", None) or type(e).__name__
                raise
            finally:
                if who and ":" in who:
                    counter.answers[who.split(":")[0]][shape].append(
                        (time.perf_counter() - t0, status))

        rest.RESTClientObject.request = counted


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def nodes_for(servers: int) -> list[dict]:
    """Enough kwok H100 nodes for ``servers`` 1-GPU pods (of one configuration at a time),
    and a CPU node."""
    n = max(1, math.ceil(servers * 1.1 / GPUS_PER_NODE))
    return [*(fake_node(f"gpu-h100-{i}", gpu_product="NVIDIA-H100", gpus=GPUS_PER_NODE)
              for i in range(n)), fake_node("cpu-0")]


def rbac_kubeconfig(cp: ControlPlane) -> str:
    """helm-values/rbac.yaml's roles for ServiceAccount gpulab-bench-hub/hub, both spawners'
    credentials. Its admission policy (the hub writes only in namespaces gpulab owns) keeps
    naming gpulab's own hub, so it does not refuse the stock spawner's unlabelled namespaces."""
    ns = "gpulab-bench-hub"
    cp.create_namespace(ns)
    docs = hub_rbac_docs(ns)
    for d in docs:
        for condition in d.get("spec", {}).get("matchConditions", []):
            condition["expression"] = condition["expression"].replace(
                f"system:serviceaccount:{ns}:hub", "system:serviceaccount:gpulab:hub")
    cp.apply(*docs)
    return cp.service_account_kubeconfig(ns, "hub")


def z2jh_queue(cp: ControlPlane, servers: int) -> None:
    """What an operator adds to run stock KubeSpawner under Kueue (``stock-kueue``): the
    namespace of the server pods, a ResourceFlavor, one ClusterQueue with enough GPUs for every
    pod (``servers`` and the warm-up's) and CPU and memory, and its LocalQueue `Z2JH_QUEUE` in
    that namespace; returns once Kueue says both are active."""
    cp.create_namespace(Z2JH_NAMESPACE)
    gpus = str(servers + 10)
    cp.apply(
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
         "metadata": {"name": "jhub-default"}, "spec": {}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
         "metadata": {"name": Z2JH_QUEUE},
         "spec": {"namespaceSelector": {
                      "matchLabels": {"kubernetes.io/metadata.name": Z2JH_NAMESPACE}},
                  "resourceGroups": [{
                      "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                      "flavors": [{"name": "jhub-default", "resources": [
                          {"name": "cpu", "nominalQuota": "100000"},
                          {"name": "memory", "nominalQuota": "10000Ti"},
                          {"name": "nvidia.com/gpu", "nominalQuota": gpus}]}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": Z2JH_QUEUE, "namespace": Z2JH_NAMESPACE},
         "spec": {"clusterQueue": Z2JH_QUEUE}},
    )

    def active(*path: str) -> bool:
        obj = cp.kubectl_json("get", *path)
        return any(c.get("type") == "Active" and c.get("status") == "True"
                   for c in obj.get("status", {}).get("conditions") or [])

    from tests.cluster.controlplane import wait_until

    wait_until(lambda: active("clusterqueue", Z2JH_QUEUE) and active(
        "localqueue", Z2JH_QUEUE, "-n", Z2JH_NAMESPACE), timeout=60,
        what=f"ClusterQueue and LocalQueue {Z2JH_QUEUE} active")


def make_config(db: str, kueue_interval: float):
    from traitlets.config import Config

    c = Config()
    c.GPULedger.db_url = f"sqlite:///{db}"
    c.GPULedger.pool = "kubernetes"
    for cls in ("KubeSpawner", "KubeGPUSpawner"):
        c[cls].profile_list = PROFILE
        c[cls].enable_user_namespaces = True
        c[cls].user_namespace_template = "gpulab-{username}"
        c[cls].storage_pvc_ensure = False
        c[cls].start_timeout = 600
        c[cls].k8s_api_request_retry_timeout = 120
    c.KubeSpawner.tolerations = [GPU_TOLERATION]  # the stock spawner needs it said
    c.KubeGPUSpawner.kueue = True
    c.KubeGPUSpawner.gpu_quota_sync_interval = kueue_interval
    return c


def z2jh_config(config):
    """``config`` for ``stock-kueue``: z2jh's one namespace for every server pod, each pod in
    the LocalQueue `Z2JH_QUEUE` (``extra_labels``)."""
    import copy

    c = copy.deepcopy(config)
    c.KubeSpawner.enable_user_namespaces = False
    c.KubeSpawner.namespace = Z2JH_NAMESPACE
    c.KubeSpawner.extra_labels = {QUEUE_NAME_LABEL: Z2JH_QUEUE}
    return c


def make_spawner(kind: str, config, name: str):
    from jupyterhub.objects import Hub
    from kubespawner import KubeSpawner

    from gpulab.spawner.kube import KubeGPUSpawner

    user = SimpleNamespace(name=name, id=1, url=f"/user/{name}/", groups=[])
    # stock, stock-kueue; gpulab, gpulab-nokueue, gpulab-poll
    cls = KubeSpawner if kind.startswith("stock") else KubeGPUSpawner
    s = cls(config=config, user=user, hub=Hub(), api_token="not-a-token",
            oauth_client_id=f"jupyterhub-user-{name}")
    if kind == "gpulab-nokueue":
        s.kueue = False
    s.user_options = {"profile": "h100-1"}
    return s


#: when each spawn's pod was created (`WHO` -> perf_counter): the spawner's own part ends there;
#: the rest is the scheduler's, Kueue's and kwok's
POD_CREATED: dict[str, float] = {}
STARTED: dict[str, float] = {}
#: when each spawn's start() returned, by the wall clock (`WHO` -> time.time()), to set against
#: the API server's timestamps
ENDED: dict[str, float] = {}


#: where the spawner's own part goes (`WHO` -> phase -> seconds): gpulab's profile and
#: admission of the GPUs (the ledger), its namespace's preparation (every API request before
#: the pod's), the manifest; the pod's create, its tries and the waits between (both sides)
PHASES: dict[str, dict[str, float]] = collections.defaultdict(dict)


def time_pod_creation() -> None:
    from kubespawner import KubeSpawner

    from gpulab.spawner.kube import KubeGPUSpawner

    def timed_phase(cls, method, phase):
        real = getattr(cls, method)

        async def timed_call(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await real(self, *args, **kwargs)
            finally:
                PHASES[WHO.get()][phase] = time.perf_counter() - t0

        setattr(cls, method, timed_call)

    timed_phase(KubeGPUSpawner, "load_user_options", "profile and admission")
    timed_phase(KubeGPUSpawner, "_ensure_namespace", "namespace, its objects, queues")
    timed_phase(KubeGPUSpawner, "get_pod_manifest", "manifest")
    original = KubeSpawner._make_create_pod_request

    async def timed(self, pod, request_timeout):  # each try; the first one starts the phase
        phases = PHASES[WHO.get()]
        phases.setdefault("_first_try", time.perf_counter())
        done = await original(self, pod, request_timeout)
        if done:
            POD_CREATED[WHO.get()] = time.perf_counter()
            phases["pod create (tries)"] = POD_CREATED[WHO.get()] - phases.pop("_first_try")
        return done

    KubeSpawner._make_create_pod_request = timed


async def read_progress(s, who: str, started) -> None:
    """What the spawn-pending page does: read the server's progress stream until the start
    ends, as JupyterHub's progress handler does (``iterate_until``: the spawner's own
    stream may go on; KubeSpawner's looks again only every second)."""
    from jupyterhub.utils import iterate_until

    WHO.set(who)
    try:
        async for _ in iterate_until(started, s.progress()):
            pass
    except Exception as e:  # noqa: BLE001 - the start's own failure is what counts
        print(f"  progress of {s.user.name}: {type(e).__name__}: {e}"[:200], flush=True)


async def one_spawn(s, key: str, progress: str | None = None) -> tuple[float, bool]:
    WHO.set(key)
    t0 = STARTED[key] = time.perf_counter()
    started = s.start()
    page = (asyncio.create_task(read_progress(s, progress, started),
                                context=contextvars.Context()) if progress else None)
    try:
        await asyncio.wait_for(started, 600)
        took = time.perf_counter() - t0  # (not waiting for the stream's last read)
        ENDED[key] = time.time()
    except Exception as e:  # noqa: BLE001 - counted as a failed start
        from kubernetes_asyncio.client.rest import ApiException

        from gpulab.hub.cluster.namespaces import api_message

        why = f"{e.status} {api_message(e)}" if isinstance(e, ApiException) else str(e)
        print(f"  {key}: failed: {type(e).__name__}: {why}"[:300], flush=True)
        return time.perf_counter() - t0, False
    finally:
        if page is not None:
            await asyncio.gather(page, return_exceptions=True)
    return took, True


async def storm(kind, config, names, counter, concurrency, tag, progress=False):
    """Start a server for each of ``names``, ``concurrency`` at once; returns (spawners,
    [(seconds, ok, requests)]). With ``progress``, each spawn's progress stream is read as
    its spawn-pending page would (its requests counted apart, as ``<tag>-progress``)."""
    sem = asyncio.Semaphore(concurrency)
    spawners = [make_spawner(kind, config, n) for n in names]

    async def go(i, s):
        async with sem:
            key = f"{tag}:{i}"
            t, ok = await asyncio.create_task(
                one_spawn(s, key, f"{tag}-progress" if progress else None),
                context=contextvars.Context())
            return t, ok, counter.by_who[key]

    results = await asyncio.gather(*(go(i, s) for i, s in enumerate(spawners)))
    return spawners, list(results)


async def stop_all(spawners, concurrency):
    sem = asyncio.Semaphore(concurrency)

    async def stop(s):
        async with sem:
            WHO.set("stop")
            try:
                await s.stop(now=True)
            except Exception as e:  # noqa: BLE001
                print(f"  stopping {s.user.name}: {e}", flush=True)
            s.clear_state()

    await asyncio.gather(*(asyncio.create_task(stop(s), context=contextvars.Context())
                           for s in spawners))


class MirrorTimer:
    """Times each pass (`sync`) of gpulab's Kueue mirror."""

    def __init__(self):
        from gpulab.hub.cluster.kueuemirror import KueueMirror

        self.passes: list[float] = []
        original = KueueMirror.sync
        timer = self

        async def timed(self):
            t0 = time.perf_counter()
            try:
                return await original(self)
            finally:
                timer.passes.append(time.perf_counter() - t0)

        KueueMirror.sync = timed


async def at_rest(seconds: float, counter: RequestCounter, timer: MirrorTimer) -> dict:
    t0, cpu0, n0, w0, p0 = (time.monotonic(), time.process_time(), counter.total,
                            counter.watches, len(timer.passes))
    shapes0 = collections.Counter()
    for c in counter.shapes.values():
        shapes0.update(c)
    await asyncio.sleep(seconds)
    wall = time.monotonic() - t0
    shapes = collections.Counter()
    for c in counter.shapes.values():
        shapes.update(c)
    shapes.subtract(shapes0)
    passes = timer.passes[p0:]
    return {"per_minute": (counter.total - n0) * 60 / wall,
            "watches_per_minute": (counter.watches - w0) * 60 / wall,
            "cpu": (time.process_time() - cpu0) / wall,
            "shapes": {k: v for k, v in shapes.items() if v > 0},
            "mirror_pass": max(passes) if passes else None,
            "mirror_passes": len(passes)}


def _when(stamp: str | None) -> float | None:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


def _since(obj: dict, kind: str) -> float | None:
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") == kind and c.get("status") == "True":
            return _when(c.get("lastTransitionTime"))
    return None


async def breakdown(pods_of: dict[tuple[str, str], float | None]) -> dict[str, list[float]]:
    """Where the storm's spawns spent their time after the pod was made, by the API
    server's own timestamps (whole seconds): the pod's creation to its Workload's, the
    Workload's to Kueue's admission (QuotaReserved), then to the scheduler's placement
    (PodScheduled), to kwok's Ready, and to the spawner seeing it (its start() returned: the
    time in ``pods_of``, (namespace, name) -> wall clock; a timestamp is the second it fell
    in, so this gap reads about 0.5 s more than it was). Two lists (not counted in any
    spawn's requests)."""
    import json

    from kubespawner.clients import shared_client

    WHO.set("probe")
    core, custom = shared_client("CoreV1Api"), shared_client("CustomObjectsApi")
    resp = await core.list_pod_for_all_namespaces(label_selector="component=singleuser-server",
                                                  _preload_content=False)
    pods = [p for p in json.loads(await resp.read())["items"]
            if (p["metadata"]["namespace"], p["metadata"]["name"]) in pods_of]
    try:
        resp = await custom.list_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "workloads",
                                                       _preload_content=False)
        workloads = json.loads(await resp.read())["items"]
    except Exception:  # noqa: BLE001 - no Kueue
        workloads = []
    of_pod = {o.get("uid"): w for w in workloads
              for o in w["metadata"].get("ownerReferences") or []}
    steps: dict[str, list[float]] = collections.defaultdict(list)
    for p in pods:
        made = _when(p["metadata"].get("creationTimestamp"))
        scheduled, ready = _since(p, "PodScheduled"), _since(p, "Ready")
        w = of_pod.get(p["metadata"].get("uid"))
        before = made
        if w is not None:
            wmade, reserved = _when(w["metadata"].get("creationTimestamp")), _since(w, "QuotaReserved")
            if wmade is not None and reserved is not None:
                steps["pod to Workload"].append(wmade - made)
                steps["Workload to admission"].append(reserved - wmade)
                before = reserved
        if scheduled is not None:
            steps["to PodScheduled"].append(scheduled - before)
            if ready is not None:
                steps["PodScheduled to Ready"].append(ready - scheduled)
        seen = pods_of.get((p["metadata"]["namespace"], p["metadata"]["name"]))
        if ready is not None and seen is not None:
            steps["Ready to seen"].append(seen - ready)
    return dict(steps)


def fill_ledger(db: str, users: list[str]) -> None:
    from gpulab.hub.quota.ledger import Ledger
    from gpulab.hub.quota.policy import Quota

    ledger = Ledger(f"sqlite:///{db}", pool="kubernetes")
    ledger.migrate()
    ledger.set_quota("default", "", Quota(max_gpus=1), actor="bench")
    for u in users:
        ledger.set_quota("user", u, Quota(max_gpus=2, gpu_hours=500, window_hours=168),
                         actor="bench")


ADMISSION_METRICS = re.compile(
    r'^apiserver_admission_(webhook|controller)_admission_duration_seconds_(sum|count)'
    r'\{([^}]*)\} ([0-9.e+-]+)$', re.M)


def admission_seconds(metrics_text: str) -> dict[str, list[float]]:
    """The API server's admission time by webhook or admission plugin, of creates (any kind):
    name -> [seconds in all, calls] (its own metrics, cumulative)."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for kind, field, labels, value in ADMISSION_METRICS.findall(metrics_text):
        tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if tags.get("operation") != "CREATE" or tags.get("rejected") == "true":
            continue
        name = f"{kind} {tags.get('name', '?')} ({tags.get('type', '?')})"
        out[name][0 if field == "sum" else 1] += float(value)
    return out


async def bench(args, kubeconfig: str, db: str, metrics=None) -> dict:
    from kubernetes_asyncio.config import kube_config
    from kubespawner import KubeSpawner
    from kubespawner.clients import load_config

    from gpulab.hub.cluster.kueuemirror import KueueMirror
    from gpulab.hub.cluster.namespaces import GPUQuotaMirror
    from gpulab.hub.quota.settings import GPULedger

    kube_config.KUBE_CONFIG_DEFAULT_LOCATION = kubeconfig
    load_config.cache_clear()
    config = make_config(db, args.kueue_interval)
    configs = {kind: z2jh_config(config) if kind == "stock-kueue" else config
               for kind in args.configs}
    counter = RequestCounter()
    timer = MirrorTimer()
    time_pod_creation()
    run = uuid.uuid4().hex[:4]
    people = [f"p{run}{i:05d}" for i in range(args.users)]
    t0 = time.monotonic()
    await asyncio.to_thread(fill_ledger, db, people)
    print(f"ledger: {args.users} people with quotas in {time.monotonic() - t0:.1f}s", flush=True)
    out = {}
    half = args.servers
    for k, kind in enumerate(args.configs):
        names = people[k * half:(k + 1) * half] if (k + 1) * half <= len(people) else [
            f"{n}{LETTER[kind]}" for n in people[:half]]
        poll = kind == "gpulab-poll"  # the progress streams as before the shared watch
        if poll:
            from gpulab.hub.cluster.kueuewatch import WorkloadWatch

            async def no_watch(self, parent):
                self.users += 1
                return False

            shared_acquire, WorkloadWatch.acquire = WorkloadWatch.acquire, no_watch
        # warm up: the shared watches, clients, the ledger, the mirrors (not counted)
        warm, _ = await storm(kind, configs[kind], [f"w{run}{LETTER[kind]}"], counter, 1,
                              f"{kind}-warm")
        t0 = time.monotonic()
        before = admission_seconds(await asyncio.to_thread(metrics)) if metrics else {}
        spawners, results = await storm(kind, configs[kind], names, counter, args.concurrency, kind,
                                        progress=args.progress)
        took = time.monotonic() - t0
        after = admission_seconds(await asyncio.to_thread(metrics)) if metrics else {}
        admission = {name: (total - before.get(name, [0, 0])[0], n - before.get(name, [0, 0])[1])
                     for name, (total, n) in after.items()}
        print(f"{kind}: {len(names)} spawns in {took:.1f}s", flush=True)
        steps = await asyncio.create_task(breakdown({(s.namespace, s.pod_name): ENDED.get(f"{kind}:{i}")
                                                    for i, s in enumerate(spawners)}),
                                          context=contextvars.Context())
        rest = await at_rest(args.rest, counter, timer)
        again = []
        if args.respawns:
            back = spawners[:args.respawns]
            await stop_all(back, args.concurrency)
            for s in back:
                s.user_options = {"profile": "h100-1"}
            _, again = await storm(kind, configs[kind], [s.user.name for s in back], counter,
                                   args.concurrency, f"{kind}-again")
        shapes = collections.Counter()
        for i in range(len(names)):
            shapes.update(counter.shapes[f"{kind}:{i}"])
        own = [POD_CREATED[f"{kind}:{i}"] - STARTED[f"{kind}:{i}"] for i in range(len(names))
               if f"{kind}:{i}" in POD_CREATED]
        phases = collections.defaultdict(list)
        for i in range(len(names)):
            for phase, t in PHASES.get(f"{kind}:{i}", {}).items():
                phases[phase].append(t)
        out[kind] = {"results": results, "rest": rest, "again": again, "storm_s": took,
                     "own": own, "steps": steps, "phases": dict(phases),
                     "answers": {k: list(v) for k, v in counter.answers[kind].items()},
                     "admission": admission,
                     "progress": counter.by_who[f"{kind}-progress"],
                     "progress_shapes": dict(counter.shapes[f"{kind}-progress"]),
                     "shapes": {k: v / len(names) for k, v in shapes.items()}}
        t0 = time.monotonic()
        await stop_all(spawners + warm, args.concurrency)
        print(f"{kind}: stopped in {time.monotonic() - t0:.1f}s", flush=True)
        if poll:
            WorkloadWatch.acquire = shared_acquire
    await KubeSpawner._stop_all_reflectors()
    for mirrors in (GPUQuotaMirror._instances, KueueMirror._instances):
        for mirror in list(mirrors.values()):
            if mirror._task is not None:
                mirror._task.cancel()
        mirrors.clear()
    GPULedger.clear_instance()
    return out


def report(args, out: dict) -> None:
    print()
    print(f"people {args.users}, servers {args.servers} per configuration, "
          f"{args.concurrency} spawns at once, {args.rest:.0f}s at rest")
    fig = {}
    for kind in args.configs:
        r = out[kind]["results"]
        times = [t for t, ok, _ in r if ok]
        fails = sum(1 for _, ok, _ in r if not ok)
        reqs = [n for _, ok, n in r if ok]
        again = out[kind]["again"]
        rest = out[kind]["rest"]
        fig[kind] = {"p50": statistics.median(times), "p99": percentile(times, 99), "fails": fails,
                     "req": statistics.median(reqs),
                     "again": statistics.median([n for _, ok, n in again if ok]) if again else None,
                     "again_p50": statistics.median([t for t, ok, _ in again if ok]) if again else None,
                     "rest": rest["per_minute"]}
        name = NAMES[kind]
        print(f"{name}: p50 {fig[kind]['p50']:.2f}s p99 {fig[kind]['p99']:.2f}s, "
              f"{fails} failed, storm {out[kind]['storm_s']:.1f}s; API requests per spawn "
              f"{fig[kind]['req']:.0f}" + (f" (returning person {fig[kind]['again']:.0f}, p50 "
                 f"{fig[kind]['again_p50']:.2f}s)" if again else ""))
        own = out[kind]["own"]
        if own:
            print(f"  start() to the pod's creation (the spawner's own part): p50 "
                  f"{statistics.median(own):.2f}s p99 {percentile(own, 99):.2f}s" + "".join(
                      f"; {phase} p50 {statistics.median(v):.2f}s p99 {percentile(v, 99):.2f}s"
                      for phase, v in out[kind].get("phases", {}).items()
                      if v and not phase.startswith("_")))
        answers = out[kind].get("answers", {})
        for shape, n in sorted(out[kind]["shapes"].items(), key=lambda kv: -kv[1]):
            took = answers.get(shape, [])
            print(f"    {n:5.2f}  {shape}" + (
                f"  (answered in p50 {statistics.median(t for t, _ in took):.2f}s p99 "
                f"{percentile([t for t, _ in took], 99):.2f}s; " + ", ".join(
                    f"{status} {k}" for status, k in collections.Counter(
                        str(st) for _, st in took).most_common()) + ")" if took else ""))
        slow = sorted(((total, n, name) for name, (total, n) in out[kind].get("admission", {}).items()
                       if n and total / n >= 0.001), reverse=True)[:6]
        if slow:
            print("  the API server's admission of creates in the storm (its metrics), by "
                  "webhook or plugin: " + "; ".join(
                      f"{name} {total:.1f}s in {n:.0f} calls, mean {1000 * total / n:.0f} ms"
                      for total, n, name in slow))
        steps = out[kind]["steps"]
        if steps:
            print("  after the pod's creation (API server timestamps, whole seconds): " + "; ".join(
                f"{name} p50 {statistics.median(v):.1f}s p99 {percentile(v, 99):.1f}s"
                for name, v in steps.items() if v))
        if args.progress:
            storm_min = out[kind]["storm_s"] / 60
            print(f"  progress streams (each spawn's page open): {out[kind]['progress']} "
                  f"requests in the storm, {out[kind]['progress'] / storm_min:.0f}/min")
            for shape, n in sorted(out[kind]["progress_shapes"].items(), key=lambda kv: -kv[1]):
                print(f"    {n:6d}  {shape}")
        print(f"  at rest: {rest['per_minute']:.1f} requests/min, "
              f"{rest['watches_per_minute']:.1f} watches opened/min, CPU {rest['cpu']:.2f}"
              + (f", Kueue mirror: {rest['mirror_passes']} passes, slowest "
                 f"{rest['mirror_pass'] * 1000:.0f} ms" if rest["mirror_pass"] is not None else ""))
        for shape, n in sorted(rest["shapes"].items(), key=lambda kv: -kv[1]):
            print(f"    {n * 60 / args.rest:6.1f}/min  {shape}")
    if "gpulab" not in fig:
        return
    g = fig["gpulab"]
    for base in ("stock", "stock-kueue"):
        if base not in fig:
            continue
        s = fig[base]
        print()
        print(f"against {NAMES[base]}:")
        print(f"  p99 spawn KubeGPUSpawner / {base}: {g['p99'] / s['p99']:.2f} (goal <= 1.2); "
              f"p50 {g['p50'] / s['p50']:.2f} (p99 {g['p99']:.2f} against {s['p99']:.2f}s, "
              f"p50 {g['p50']:.2f} against {s['p50']:.2f}s); failed {g['fails']} against "
              f"{s['fails']} of {args.servers}")
        print(f"  API requests per spawn: {base} {s['req']:.0f}, KubeGPUSpawner {g['req']:.0f}, "
              f"extra {g['req'] - s['req']:+.0f} (goal <= +3)"
              + (f"; returning person {g['again'] - s['again']:+.0f}"
                 if g["again"] is not None and s["again"] is not None else ""))
        print(f"  at rest: {base} {s['rest']:.1f}, KubeGPUSpawner {g['rest']:.1f} requests/min")
    if args.progress:
        print("progress streams in the storm: " + ", ".join(
            f"{kind} {out[kind]['progress']} requests ({out[kind]['progress'] * 60 / out[kind]['storm_s']:.0f}/min)"
            for kind in args.configs))


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=200, help="people in the ledger")
    parser.add_argument("--servers", type=int, default=40,
                        help="servers (pods) each configuration starts")
    parser.add_argument("--concurrency", type=int, default=10, help="spawns at once")
    parser.add_argument("--rest", type=float, default=30.0, help="seconds at rest")
    parser.add_argument("--respawns", type=int, default=5,
                        help="spawns again of people who ran a server (0: none)")
    parser.add_argument("--kueue-interval", type=float, default=3.0,
                        help="seconds between the Kueue mirror's passes (gpulab's default 3)")
    parser.add_argument("--kueue-qps", type=int, default=0,
                        help="Kueue's client QPS (burst twice that); 0: the test cluster's "
                             "(tests/cluster/queueing.py KUEUE_CLIENT_CONNECTION: 500, burst "
                             "1000; Kueue's release manifests say 50, burst 100)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="do not read each spawn's progress stream (its pending page)")
    parser.add_argument("--kueue-pod-concurrency", type=int, default=0,
                        help="Kueue's Pod and Workload reconcilers at once; 0: the test "
                             "cluster's (tests/cluster/queueing.py: 20; Kueue's release "
                             "manifests say 5)")
    parser.add_argument("--configs", default="stock,stock-kueue,gpulab",
                        help="which to run, in order: stock (no Kueue, a namespace per "
                             "person), stock-kueue (z2jh's one namespace, its pods in one "
                             "LocalQueue of Kueue), gpulab (with Kueue), "
                             "gpulab-nokueue (KubeGPUSpawner with the ResourceQuota instead), "
                             "gpulab-poll (with Kueue, each progress stream listing its "
                             "Workloads every 2 s instead of the hub's shared watch)")
    args = parser.parse_args(argv)
    args.configs = args.configs.split(",")
    unknown = [k for k in args.configs if k not in NAMES]
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(NAMES)})")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    subprocess.run(["bash", str(BUILD_SCRIPT), "--quiet"], check=True)
    kueue_settings = ({"clientConnection": {"qps": args.kueue_qps, "burst": 2 * args.kueue_qps}}
                      if args.kueue_qps else {})
    if args.kueue_pod_concurrency:
        from tests.cluster.queueing import KUEUE_GROUP_KIND_CONCURRENCY

        n = args.kueue_pod_concurrency
        kueue_settings["controller"] = {"groupKindConcurrency": {
            **KUEUE_GROUP_KIND_CONCURRENCY, "Pod": n, "Workload.kueue.x-k8s.io": n}}
    with (ControlPlane(queueing=True, nodes=nodes_for(args.servers),
                       kueue_settings=kueue_settings) as cp,
          tempfile.TemporaryDirectory(prefix="gpulab-bench-") as tmp):
        from tests.cluster.queueing import KUEUE_CLIENT_CONNECTION

        print(f"control plane with Kueue and {len(cp.nodes) - 1} GPU nodes up in "
              f"{cp.startup_seconds:.1f}s; Kueue's clientConnection "
              f"{kueue_settings.get('clientConnection', KUEUE_CLIENT_CONNECTION)}"
              + (f", controller {kueue_settings['controller']}" if "controller" in kueue_settings
                 else ""), flush=True)
        kubeconfig = rbac_kubeconfig(cp)
        if "stock-kueue" in args.configs:
            z2jh_queue(cp, args.servers)
        out = asyncio.run(bench(args, kubeconfig, str(Path(tmp) / "gpulab.sqlite"),
                                metrics=lambda: cp.api("GET", "/metrics", expect=[200])[1]))
    report(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
