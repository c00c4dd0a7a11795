"""Your notebook kernel coordinates your own training cluster (issue 38).

``cluster = gpulab.cluster(ps=2, workers=4, gpus_per_worker=1)`` holds parameter servers and
workers for the kernel it runs in, through the same jobs API, quota, ledger and queue as a
training job (a job spec of kind ``cluster``): it waits in line with its place shown while
the GPUs are busy, and returns once every server accepts connections. Then this kernel is the
coordinator, as in TensorFlow's parameter-server tutorial:

- ``cluster.strategy()``: a ``tf.distribute.experimental.ParameterServerStrategy`` over the
  cluster (``Model.fit`` under it, or ``ClusterCoordinator(strategy).schedule`` / ``join``);
- ``cluster.resolver``: a ``SimpleClusterResolver`` (``rpc_layer`` grpc) for code that builds
  its own strategy;
- ``cluster.stop()``: the servers end and the GPUs come back.

The cluster lives while this kernel renews its lease (a daemon thread, every third of the
hub's ``c.GPUJobs.cluster_lease_timeout``): when the kernel shuts down or restarts, or its
server stops, the renewals stop and the hub stops the cluster. A restarted kernel re-attaches
to a cluster still held with ``gpulab.cluster(name="...")`` (the name ``gpulab.cluster()``
printed). Each renewal says how long no step was dispatched (``ClusterCoordinator.schedule``,
which ``Model.fit`` calls too): the hub stops a cluster idle longer than
``c.GPUJobs.cluster_idle_timeout``. A lost worker is restarted by gpulab (TensorFlow's
coordinator carries on meanwhile); a lost parameter server ends the cluster, and this kernel
prints why and what to do.

Importing this module imports neither TensorFlow nor the hub; TensorFlow is imported by
`Cluster.strategy` and `Cluster.resolver` only.
"""

from __future__ import annotations

import secrets
import socket
import sys
import threading
import time
from typing import Callable

from .client import Client, GpulabError
from .contract import CLUSTER, FINAL

#: how long `cluster` waits for the servers to accept connections once they run (seconds)
SERVING_TIMEOUT = 300.0
#: a renewal every this many seconds when the hub says no lease time
DEFAULT_RENEW = 20.0

_dispatch_lock = threading.Lock()
#: monotonic time a step was last dispatched in this process (`ClusterCoordinator.schedule`)
_last_dispatch = [time.monotonic()]
_watching = [False]


def _note_dispatch() -> None:
    _last_dispatch[0] = time.monotonic()


def watch_dispatches() -> None:
    """Stamp every ``ClusterCoordinator.schedule`` of this process (the tutorial's custom
    loop, and ``Model.fit`` under a ``ParameterServerStrategy``), for the idle time each
    lease renewal reports. Imports TensorFlow; once per process."""
    with _dispatch_lock:
        if _watching[0]:
            return
        import tensorflow as tf

        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator
        schedule = coordinator.schedule

        def stamped(self, fn, args=None, kwargs=None):
            _note_dispatch()
            return schedule(self, fn, args=args, kwargs=kwargs)

        stamped.__doc__ = schedule.__doc__
        coordinator.schedule = stamped
        _watching[0] = True


def _status_line() -> Callable[[str], None]:
    """A line that shows the newest text only: an updating output in a notebook, ``\\r`` on
    a terminal."""
    try:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is not None and "ipykernel" in sys.modules:
            handle = display({"text/plain": ""}, raw=True, display_id=True)
            return lambda text: handle.update({"text/plain": text}, raw=True)
    except ImportError:
        pass
    return lambda text: print("\r" + text, end="", flush=True)


def waiting_words(view: dict) -> str:
    """A queued cluster's place in words (its view's ``queue``)."""
    q = view.get("queue") or {}
    if q.get("held"):
        return f"Cluster {view['name']}: held in the queue by an admin ({q.get('reason') or ''})"
    where = f"#{q['position']} in line" if q.get("position") else "in line"
    ahead = q.get("ahead")
    words = f"Cluster {view['name']} waits for {view['gpus']} GPU(s): {where}"
    if ahead:
        words += f", {ahead} request(s) with {q.get('ahead_gpus', '?')} GPU(s) ahead"
    if q.get("estimated_start"):
        words += f", estimated start {time.strftime('%H:%M', time.localtime(q['estimated_start']))}"
    if q.get("reason"):
        words += f" ({q['reason']})"
    return words


def _serving(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


class Cluster:
    """A cluster held for this kernel (see the module). ``view``: its last known state."""

    def __init__(self, client: Client, view: dict, *, say: Callable[[str], None] = print):
        self.client, self.view, self.name = client, view, view["name"]
        self._say = say
        self._stopped = threading.Event()
        self._renew = DEFAULT_RENEW
        self._thread: threading.Thread | None = None
        self.ended: str | None = None  # why it ended, once the lease thread saw it

    def __repr__(self) -> str:
        return (f"<gpulab Cluster {self.name!r} {self.view.get('state')}: "
                f"{len(self.addresses.get('ps', []))} ps, "
                f"{len(self.addresses.get('worker', []))} workers>")

    # -- what the coordinator needs -------------------------------------------------------

    @property
    def addresses(self) -> dict[str, list[str]]:
        """``{"ps": ["host:port", ...], "worker": [...]}``: where the servers listen."""
        return self.view.get("cluster") or {}

    @property
    def resolver(self):
        """A ``tf.distribute.cluster_resolver.SimpleClusterResolver`` of the cluster
        (``rpc_layer`` grpc; no task: this kernel is the coordinator)."""
        watch_dispatches()
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.addresses), rpc_layer="grpc")

    def strategy(self, variable_partitioner=None):
        """A ``tf.distribute.experimental.ParameterServerStrategy`` whose coordinator is this
        kernel (``variable_partitioner`` as TensorFlow's, e.g.
        ``tf.distribute.experimental.partitioners.MinSizePartitioner``)."""
        import tensorflow as tf

        return tf.distribute.experimental.ParameterServerStrategy(
            self.resolver, variable_partitioner=variable_partitioner)

    # -- life ------------------------------------------------------------------------------

    def status(self) -> dict:
        """The cluster now (state, reason, replicas, gpus, queue place while it waits)."""
        self.view = self.client.request("GET", f"jobs/{self.name}")
        return self.view

    @property
    def state(self) -> str:
        return self.status()["state"]

    def stop(self) -> dict:
        """End the servers; their GPUs come back. The cluster's state afterwards."""
        self._stopped.set()
        self.view = self.client.request("POST", f"jobs/{self.name}/stop")
        return self.view

    def renew(self) -> dict:
        """Renew the lease once (the lease thread does this); raises `GpulabError` 409 once
        the cluster has ended."""
        if not _watching[0] and "tensorflow" in sys.modules:  # a resolver of their own
            try:
                watch_dispatches()
            except Exception:  # noqa: BLE001 - a TensorFlow without the coordinator
                pass
        idle = max(0.0, time.monotonic() - _last_dispatch[0])
        view = self.client.request("POST", f"jobs/{self.name}/lease", body={"idle_for": idle})
        lease = view.pop("lease", None) or {}
        if lease.get("timeout"):
            self._renew = max(1.0, float(lease["timeout"]) / 3)
        self.view = view
        return view

    def _keep(self) -> None:
        """The lease thread: renew until stopped; say it when the cluster ends otherwise."""
        while not self._stopped.wait(self._renew):
            try:
                self.renew()
            except GpulabError as e:
                if e.status in (404, 409):  # ended (or gone): say why, once
                    try:
                        view = self.status()
                        why = f"{view['state']}: {view['reason']}"
                    except GpulabError:
                        why = e.message
                    if not self._stopped.is_set():
                        self.ended = why
                        print(f"\ngpulab: cluster {self.name} ended ({why})", file=sys.stderr,
                              flush=True)
                    return
            except Exception:  # noqa: BLE001 - the service restarts: try again next time
                continue

    def _hold(self) -> None:
        _note_dispatch()  # idle time counts from now
        self.renew()
        if self._thread is None or not self._thread.is_alive():
            self._stopped.clear()
            self._thread = threading.Thread(target=self._keep, daemon=True,
                                            name=f"gpulab-cluster-{self.name}")
            self._thread.start()

    def wait_serving(self, timeout: float | None = None, show: Callable[[str], None] | None = None
                     ) -> Cluster:
        """Wait (its place shown while it is in line) until every server accepts
        connections; `GpulabError` if the cluster ends meanwhile, `TimeoutError` after
        ``timeout`` seconds."""
        show = show or _status_line()
        deadline = None if timeout is None else time.monotonic() + timeout
        serving_since = None
        while True:
            view = self.status()
            state = view["state"]
            if state in FINAL:
                self._stopped.set()
                show(f"Cluster {self.name}: {state}: {view['reason']}")
                raise GpulabError(f"The cluster {self.name} ended before it served "
                                  f"({state}): {view['reason']}", 409)
            if state == "Queued":
                show(waiting_words(view))
            else:
                addresses = [a for role in ("ps", "worker") for a in self.addresses.get(role, [])]
                up = [a for a in addresses if _serving(a)]
                if addresses and len(up) == len(addresses):
                    show(f"Cluster {self.name}: {len(self.addresses.get('ps', []))} ps and "
                         f"{len(self.addresses.get('worker', []))} workers serving "
                         f"({view['gpus']} GPU(s)); re-attach from another kernel with "
                         f"gpulab.cluster(name={self.name!r})")
                    return self
                serving_since = serving_since or time.monotonic()
                show(f"Cluster {self.name}: starting, {len(up)} of {len(addresses)} servers up")
                if time.monotonic() - serving_since > SERVING_TIMEOUT:
                    raise TimeoutError(f"the servers of cluster {self.name} did not all accept "
                                       f"connections within {SERVING_TIMEOUT:g} s; see their "
                                       f"logs (gpulab jobs logs {self.name} worker-0)")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"cluster {self.name} is still {state} after {timeout} s")
            time.sleep(1.0)


def cluster_spec(*, name: str, ps: int = 1, workers: int = 1, gpus_per_worker: int = 0,
                 gpus_per_ps: int = 0, cpu: float | None = None, memory: str | None = None,
                 max_runtime: int | None = None, retries: int | None = None,
                 priority: int | None = None) -> dict:
    """The jobs API's spec of a held cluster (kind ``cluster``) from `cluster`'s words."""
    worker: dict = {"gpus": gpus_per_worker}
    if cpu is not None:
        worker["cpu"] = cpu
    if memory is not None:
        worker["memory"] = memory
    spec: dict = {"name": name, "kind": CLUSTER, "strategy": "parameter-server",
                  "replicas": {"ps": ps, "worker": workers}, "resources": {"worker": worker}}
    if gpus_per_ps:
        spec["resources"]["ps"] = {"gpus": gpus_per_ps}
    for key, value in (("max_runtime", max_runtime), ("retries", retries),
                       ("priority", priority)):
        if value is not None:
            spec[key] = value
    return spec


def cluster(ps: int = 1, workers: int = 1, gpus_per_worker: int = 0, *, name: str | None = None,
            gpus_per_ps: int = 0, cpu: float | None = None, memory: str | None = None,
            max_runtime: int | None = None, retries: int | None = None,
            priority: int | None = None, timeout: float | None = None,
            client: Client | None = None) -> Cluster:
    """Hold ``ps`` parameter servers and ``workers`` workers (``gpus_per_worker`` GPUs each)
    for this kernel, and return once they serve (see the module).

    ``name``: a cluster of yours still held under that name is re-attached (its lease renewed
    from this kernel; the other arguments are not used); otherwise one is made with that
    name (default: ``cluster-<random>``, printed). ``timeout``: seconds to wait in line and
    for the servers (None: as long as it takes). Raises `GpulabError` with the service's
    words when it is refused (quota, sizes, no running server).
    """
    client = client or Client()
    if name is not None:
        try:
            view = client.request("GET", f"jobs/{name}")
        except GpulabError as e:
            if e.status != 404:
                raise
            view = None
        if view is not None:
            if view.get("kind") != CLUSTER:
                raise GpulabError(f"'{name}' is a training job of yours, not a cluster; "
                                  "choose another name.", 409, "name")
            if view["state"] in FINAL:
                raise GpulabError(f"Your cluster '{name}' has ended ({view['state']}: "
                                  f"{view['reason']}); hold a new one under another name.",
                                  409, "name")
            held = Cluster(client, view)
            held._hold()
            print(f"Re-attached to cluster {name} ({view['state']}).")
            return held.wait_serving(timeout)
    name = name or f"cluster-{secrets.token_hex(3)}"
    spec = cluster_spec(name=name, ps=ps, workers=workers, gpus_per_worker=gpus_per_worker,
                        gpus_per_ps=gpus_per_ps, cpu=cpu, memory=memory,
                        max_runtime=max_runtime, retries=retries, priority=priority)
    view = client.request("POST", "jobs", body=spec)
    held = Cluster(client, view)
    try:
        held._hold()
        return held.wait_serving(timeout)
    except KeyboardInterrupt:  # the person gave up waiting: the GPUs go back at once
        held.stop()
        raise


__all__ = ["Cluster", "cluster", "cluster_spec", "waiting_words", "watch_dispatches"]
