"""Test doubles, one behaviour each. Real parts are preferred (conventions 11): a double is
for a unit test of logic that would otherwise need a running hub.

Index:

- `FakeClient`: stands in for `gpulab.extensions.client.Client` in the unit tests of the
  notebook widgets and the cell magic (tests/unit/test_widgets.py). It answers ``me``,
  ``jobs``, ``job(name)`` (a `FakeJob`) and ``submit`` from canned data and records every
  call with its time. The real client against a real service is tested in
  tests/app/test_client.py.
- `FakeJob`: a job of `FakeClient` whose ``status()`` walks through a scripted list of views
  (the last one repeats) and whose logs are canned text per replica.
"""

from __future__ import annotations

import copy
import time

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

    def read_log(self, replica, offset=0, follow=False):
        self._record(f"log:{replica}:{offset}")
        text = self._logs.get(replica, "").encode()
        piece = text[offset:offset + (1 << 20)]
        done = self._views[0]["state"] in ("Succeeded", "Failed", "Stopped")
        return {"replica": replica, "text": piece.decode(), "offset": offset + len(piece),
                "size": len(text), "done": done}


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


__all__ = ["FakeClient", "FakeJob", "job_view", "ME", "GpulabError"]
