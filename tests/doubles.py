"""Test doubles, one behaviour each. Real parts are preferred (conventions 11): a double is
for a unit test of logic that would otherwise need a running hub.

Index:

- `FakeClient`: stands in for `gpulab.extensions.client.Client` in the unit tests of the
  notebook widgets and the cell magic (tests/unit/test_widgets.py). It answers ``me``,
  ``jobs``, ``job(name)`` (a `FakeJob`) and ``submit`` from canned data and records every
  call with its time. The real client against a real service is tested in
  tests/app/test_client.py.
- `FakeJob`: a job of `FakeClient` whose ``status()`` walks through a scripted list of views
  (the last one repeats) and whose logs are canned text per replica, answered as the service
  does (rendered as a terminal shows it by `gpulab.extensions.joblog`, or raw).
- `FakeKubeAPI`: stands in for kubernetes_asyncio's ``CoreV1Api`` and ``NetworkingV1Api`` in
  the unit tests of a user namespace's preparation (tests/unit/test_namespaces.py): it
  answers the writes `gpulab.hub.cluster.namespaces` makes (server-side apply of a namespace, a
  NetworkPolicy, a ResourceQuota; a policy's replacement; a quota's deletion) with what an API
  server would store, keeping the ``spec`` fields another field manager added to a policy
  (``foreign``), and records each call. The real API server (bound by the hub's RBAC) is in
  tests/cluster/test_kube_spawner.py and test_kube_jobs.py.
- `FakeHubDirectory`: stands in for the gpulab service's `HubDirectory` in the unit tests of
  GPU-idle culling's rounds (tests/unit/test_gpu_telemetry.py): the hub's users with their
  groups and their servers' chosen profiles, and a record of the servers it was asked to
  stop. The real hub stops a culled server in tests/app/test_gpu_idle.py.
- `FakeJobs`: a job backend that records the jobs it was asked to stop, with the reason.
"""

from __future__ import annotations

import copy
import time

from gpulab.extensions import joblog
from gpulab.extensions.client import GpulabError

ME = {"user": "ann", "quota": {"max_gpus": 4, "max_per_request": None, "gpu_hours": None,
                               "window_hours": None},
      "quota_text": "4 GPUs at once", "gpus_held": 1,
      "holdings": [{"kind": "notebook", "name": "default", "gpus": 1}],
      "inventory": {"total": 8, "free": 5, "simulated": True},
      "jobs": {"backend": "local", "images": [], "available": True, "reason": ""}}


def job_view(name="digits", state="Running", strategy="parameter-server", progress=None,
             started_at=1000.0, finished_at=None, reason="", gpus=2):
    roles = (["chief-0", "ps-0", "worker-0", "worker-1"] if strategy == "parameter-server"
             else ["worker-0", "worker-1"])
    return {"name": name, "user": "ann", "strategy": strategy, "state": state, "reason": reason,
            "gpus": gpus, "started_at": started_at, "finished_at": finished_at,
            "progress": progress,
            "replicas": [{"name": r, "role": r.split("-")[0], "index": int(r.split("-")[1]),
                          "state": state, "restarts": 0, "exit_code": None,
                          "devices": [i] if r.startswith("worker") else [], "reason": ""}
                         for i, r in enumerate(roles)]}


class FakeJob:
    def __init__(self, client, name, views=None, logs=None):
        self.client, self.name = client, name
        self._views = list(views or [job_view(name)])
        self._logs = dict(logs or {})
        self.view = None

    def _record(self, what):
        self.client.calls.append((time.monotonic(), what, self.name))

    def status(self):
        self._record("status")
        view = self._views.pop(0) if len(self._views) > 1 else self._views[0]
        self.view = copy.deepcopy(view)
        return self.view

    def stop(self):
        self._record("stop")
        if self.client.refuse_stop:
            raise self.client.refuse_stop
        final = dict(self._views[-1], state="Stopped", reason="stopped by ann")
        self._views = [final]
        self.view = copy.deepcopy(final)
        return self.view

    def read_log(self, replica, offset=0, follow=False, raw=False):
        """The service's answer: rendered from the start of the line open at ``offset``
        (`gpulab.extensions.joblog`, as the service does), or ``raw``."""
        self._record(f"log:{replica}:{offset}")
        text = self._logs.get(replica, "").encode()
        piece = text[offset:offset + (1 << 20)]
        done = self._views[0]["state"] in ("Succeeded", "Failed", "Stopped")
        start = offset if raw else joblog.open_line_start(text[:offset], from_start=True)
        shown = (piece if raw else text[start:offset] + piece).decode()
        return {"replica": replica, "text": shown if raw else joblog.render_text(shown),
                "offset": offset + len(piece), "from": start, "size": len(text), "done": done}


class FakeClient:
    def __init__(self, me=None, jobs=None, refuse_submit=None, refuse_me=None,
                 refuse_stop=None):
        self._me = copy.deepcopy(ME if me is None else me)
        self._jobs: dict[str, FakeJob] = {}
        self.refuse_submit, self.refuse_me, self.refuse_stop = refuse_submit, refuse_me, refuse_stop
        self.calls: list[tuple[float, str, str | None]] = []
        self.submitted: list[dict] = []
        for name, (views, logs) in (jobs or {}).items():
            self._jobs[name] = FakeJob(self, name, views, logs)

    def me(self):
        self.calls.append((time.monotonic(), "me", None))
        if self.refuse_me:
            raise self.refuse_me
        return copy.deepcopy(self._me)

    def jobs(self):
        self.calls.append((time.monotonic(), "jobs", None))
        return [j._views[0] for j in self._jobs.values()]

    def job(self, name):
        if name not in self._jobs:
            self._jobs[name] = FakeJob(self, name)
        return self._jobs[name]

    def submit(self, spec):
        self.calls.append((time.monotonic(), "submit", spec.get("name")))
        if self.refuse_submit:
            raise self.refuse_submit
        self.submitted.append(spec)
        job = FakeJob(self, spec["name"], [job_view(spec["name"], "Starting")])
        job.view = job._views[0]
        self._jobs[spec["name"]] = job
        return job


class FakeKubeAPI:
    def __init__(self, foreign: dict[tuple[str, str], dict] | None = None):
        #: (namespace, policy name) -> spec fields another field manager owns there
        self.foreign = dict(foreign or {})
        self.stored: dict[tuple[str, str, str], dict] = {}  # (kind, namespace, name) -> object
        self.calls: list[tuple[str, str]] = []  # (method, namespace/name)
        self.api_client = self  # for api.api_client.sanitize_for_serialization
        self._version = 0

    def sanitize_for_serialization(self, obj):
        return copy.deepcopy(obj)

    def _store(self, kind: str, namespace: str, name: str, body: dict) -> dict:
        self._version += 1
        obj = copy.deepcopy(body)
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._version)
        self.stored[(kind, namespace, name)] = obj
        return copy.deepcopy(obj)

    async def patch_namespace(self, name, body, **kwargs):
        assert kwargs.get("_content_type") == "application/apply-patch+yaml"
        self.calls.append(("patch_namespace", name))
        return self._store("Namespace", "", name, body)

    async def patch_namespace_with_http_info(self, name, body, **kwargs):
        """`patch_namespace` (as a test may have replaced it), with the status: 201 where it
        made the namespace, as the API server answers a server-side apply that creates."""
        new = ("Namespace", "", name) not in self.stored
        return await self.patch_namespace(name, body, **kwargs), 201 if new else 200, {}

    async def patch_namespaced_network_policy(self, name, namespace, body, **kwargs):
        assert kwargs.get("_content_type") == "application/apply-patch+yaml"
        self.calls.append(("patch_namespaced_network_policy", f"{namespace}/{name}"))
        obj = copy.deepcopy(body)
        obj["spec"].update(copy.deepcopy(self.foreign.get((namespace, name), {})))
        return self._store("NetworkPolicy", namespace, name, obj)

    async def replace_namespaced_network_policy(self, name, namespace, body, **kwargs):
        self.calls.append(("replace_namespaced_network_policy", f"{namespace}/{name}"))
        self.foreign.pop((namespace, name), None)  # a replacement drops the others' fields
        return self._store("NetworkPolicy", namespace, name, body)

    async def patch_namespaced_resource_quota(self, name, namespace, body, **kwargs):
        assert kwargs.get("_content_type") == "application/apply-patch+yaml"
        self.calls.append(("patch_namespaced_resource_quota", f"{namespace}/{name}"))
        return self._store("ResourceQuota", namespace, name, body)

    async def patch_namespaced_service_account(self, name, namespace, body, **kwargs):
        assert kwargs.get("_content_type") == "application/apply-patch+yaml"
        self.calls.append(("patch_namespaced_service_account", f"{namespace}/{name}"))
        return self._store("ServiceAccount", namespace, name, body)

    async def delete_namespaced_resource_quota(self, name, namespace, **kwargs):
        from kubernetes_asyncio.client.rest import ApiException

        self.calls.append(("delete_namespaced_resource_quota", f"{namespace}/{name}"))
        if self.stored.pop(("ResourceQuota", namespace, name), None) is None:
            raise ApiException(status=404, reason="Not Found")
        return {"status": "Success"}


__all__ = ["FakeClient", "FakeJob", "FakeKubeAPI", "job_view", "ME", "GpulabError"]


def offline_kubeconfig(tmp_path, monkeypatch) -> None:
    """A Kubernetes client configuration that a spawner or a job backend loads when it is
    made, pointing nowhere: no request is ever sent (tests that build objects, not a cluster)."""
    from kubernetes_asyncio.config import kube_config
    from kubespawner.clients import load_config

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: none\n"
        "clusters: [{name: none, cluster: {server: 'https://127.0.0.1:9'}}]\n"
        "contexts: [{name: none, context: {cluster: none, user: none}}]\n"
        "users: [{name: none, user: {token: none}}]\n")
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    load_config.cache_clear()


class FakeHubDirectory:
    """Users ``{name: (groups, {server: profile})}`` as the hub would list them."""

    def __init__(self, users: dict):
        self._users = users
        self.stopped: list[tuple[str, str]] = []

    async def users(self):
        return [{"name": n, "groups": list(g), "admin": False} for n, (g, _) in self._users.items()]

    async def _all_users(self):
        return [{"name": n, "groups": list(g),
                 "servers": {("" if s == "default" else s): {"user_options": {"profile": p}}
                             for s, p in servers.items()}}
                for n, (g, servers) in self._users.items()]

    async def stop_server(self, user: str, server: str) -> int:
        self.stopped.append((user, server))
        return 204


class FakeJobs:
    """Records ``stop(user, name, reason=…, actor=…)``."""

    def __init__(self):
        self.stopped: list[tuple[str, str, str]] = []

    async def stop(self, user, name, actor=None, reason=None):
        self.stopped.append((user, name, reason))
        return {}
