"""The OpenAPI 3 document of the gpulab service's REST API (served at ``api/v1/openapi.json``).

A test checks that its paths and methods are exactly the handlers' (`make_app`).
"""

from __future__ import annotations

from gpulab.extensions.contract import STATES

from gpulab.hub.quota.policy import MAX_DISK, MAX_GPU_HOURS, MAX_GPUS, MAX_WINDOW_HOURS, MIN_DISK
from gpulab.hub.service.base import PAGE_DEFAULT, PAGE_MAX

ERROR = {"$ref": "#/components/schemas/Error"}


def _resp(schema: dict | None, *codes: int, ok: int = 200) -> dict:
    out = {}
    out[str(ok)] = ({"description": "OK", "content": {"application/json": {"schema": schema}}}
                    if schema else {"description": "Done"})
    words = {400: "Bad input; `field` names the field", 401: "Not logged in",
             403: "Missing scope", 404: "Not found", 409: "Conflict (see message)",
             413: "Body too large"}
    for c in (401, 403, *codes):
        out[str(c)] = {"description": words[c], "content": {"application/json": {"schema": ERROR}}}
    return out


QUOTA_IN = {
    "type": "object",
    "additionalProperties": False,
    "required": ["max_gpus"],
    "properties": {
        "max_gpus": {"type": "integer", "minimum": 0, "maximum": MAX_GPUS,
                     "description": "GPUs held at once, notebooks and jobs together"},
        "max_per_request": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_GPUS},
        "gpu_hours": {"type": ["number", "null"], "minimum": 0, "maximum": MAX_GPU_HOURS,
                      "description": "GPU-hour budget over the rolling window"},
        "window_hours": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_WINDOW_HOURS},
        "disk": {"type": ["integer", "string", "null"],
                 "description": "the person's disk on the shared storage: bytes, or a size "
                                "such as \"20G\" (binary units K, M, G, T, P); answered in "
                                f"bytes; {MIN_DISK} to {MAX_DISK} bytes"},
    },
}
QUOTA_OUT = {
    "type": "object",
    "properties": {
        "scope": {"type": "string", "enum": ["default", "group", "user"]},
        "name": {"type": "string"},
        **QUOTA_IN["properties"],
        "updated_at": {"type": "number"},
        "updated_by": {"type": "string"},
    },
}
#: how busy one device is now (NVML), or why that is not known
DEVICE_USAGE = {"type": "object", "required": ["device", "measured"], "properties": {
    "device": {"type": "integer"}, "measured": {"type": "boolean"},
    "why": {"type": "string", "enum": ["simulated", "not measured"],
            "description": "Only when not measured: a simulated GPU, or NVML cannot read it"},
    "gpu_percent": {"type": "integer", "minimum": 0, "maximum": 100,
                    "description": "Percent of the last sample period in which a kernel ran"},
    "memory_used_mib": {"type": "integer"}, "memory_total_mib": {"type": "integer"},
    "at": {"type": "number", "description": "When the source was read (Unix time)"},
    "source": {"type": "string", "enum": ["nvml", "stand-in", "dcgm"],
               "description": "Where the figures came from (c.GPUInventory.usage_source)"},
    "simulated": {"type": "boolean", "description": "stand-in figures of a simulated GPU"},
    "pod": {"type": "string", "description": "DCGM: the pod holding the GPU"},
    "namespace": {"type": "string", "description": "DCGM: the pod's namespace"},
    "text": {"type": "string", "description": "The same in words, as the pages show it"}}}
HOLDING = {"type": "object", "properties": {
    "id": {"type": "string"}, "kind": {"type": "string", "enum": ["notebook", "job", "cluster"],
                                       "description": "cluster: a cluster held for a "
                                       "notebook (gpulab.cluster)"},
    "name": {"type": "string"}, "gpus": {"type": "integer"},
    "devices": {"type": "array", "items": {"type": "integer"}}, "since": {"type": "number"},
    "usage": {"type": "array", "items": DEVICE_USAGE,
              "description": "One entry per device; in a counting pool (Kubernetes) one "
                             "per GPU the DCGM exporter sees in the holding's pods"}}}


#: every list API is paged (JupyterHub's shape): ``offset`` and ``limit`` in, ``_pagination``
#: out; a bad value is a 400 naming it
OFFSET = {"name": "offset", "in": "query", "required": False,
          "schema": {"type": "integer", "minimum": 0, "default": 0},
          "description": "how many items of the list to skip"}


def _limit(default: int = PAGE_DEFAULT) -> dict:
    return {"name": "limit", "in": "query", "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": PAGE_MAX, "default": default},
            "description": f"the most items in one answer (at most {PAGE_MAX}); follow "
                           "`_pagination.next` for the rest"}


PAGINATION = {"type": "object", "properties": {
    "offset": {"type": "integer"}, "limit": {"type": "integer"},
    "total": {"type": "integer", "description": "how many items the whole list has"},
    "next": {"type": ["object", "null"], "description": "`{offset, limit}` of the next page; "
             "null on the last"}}}


def _paged(properties: dict) -> dict:
    """The schema of one page of a list answer."""
    return {"type": "object", "properties": {**properties, "_pagination": PAGINATION}}


NAME = {"name": "name", "in": "path", "required": True,
        "schema": {"type": "string", "minLength": 1, "maxLength": 255}}


def _jobspec_schemas() -> dict:
    from gpulab.hub.jobs.spec import JobSpec

    schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return {"JobSpec": schema, **defs}


JOB = {"type": "object", "properties": {
    "name": {"type": "string"}, "user": {"type": "string"},
    "kind": {"type": "string", "enum": ["job", "cluster"], "description": "job: gpulab runs "
             "the program; cluster: ps and workers held for the notebook kernel that "
             "coordinates them"},
    "cluster": {"type": "object", "description": "a held cluster's addresses, for its owner "
                "only: where their kernels reach its servers (grpc)", "properties": {
                    "ps": {"type": "array", "items": {"type": "string"}},
                    "worker": {"type": "array", "items": {"type": "string"}}}},
    "state": {
        "type": "string", "enum": list(STATES)},
    "reason": {"type": "string"}, "gpus": {"type": "integer"},
    "replicas": {"type": "array", "items": {"$ref": "#/components/schemas/Replica"}},
    "spec": {"type": "object"},
    "progress": {"type": ["object", "null"], "description": "the last progress line of the "
                 "chief (or worker 0): step, total and metrics"},
    "queue": {"type": ["object", "null"], "description": "a Queued job's place: position "
              "(null: held by an admin), estimated_start (Unix time: the earliest start from the "
              "time limits of the work holding the GPUs and of the work ahead; null: unknown, "
              "the reason says why), ahead and ahead_gpus (the work before it), reason (why it "
              "waits, in words), held, preemptible"}}}
RESTART = {"type": "object", "description": "One restart of a replica (oldest first)",
           "properties": {
    "restart": {"type": "integer", "description": "which restart (1: the first)"},
    "attempt": {"type": "integer", "description": "the run it started (the first run is 1)"},
    "at": {"type": "number", "description": "when (Unix time)"},
    "exit_code": {"type": ["integer", "null"], "description": "how the attempt before it "
                  "ended: the process's exit code (negative: killed by that signal; "
                  "Kubernetes: the container's, 137 = 128 + SIGKILL); null: it was stopped "
                  "to restart with other replicas (a multi-worker job restarts all workers)"},
    "signal": {"type": ["string", "null"], "description": "the signal that ended it "
               "(SIGKILL, SIGTERM, …), where one did"},
    "oom_killed": {"type": "boolean", "description": "killed for using more memory than its "
                   "limit (its control group, or Kubernetes' OOMKilled, says so)"},
    "reason": {"type": "string", "description": "why, in words"},
    "pod": {"type": "string", "description": "Kubernetes: the pod that ended"}}}
REPLICA = {"type": "object", "properties": {
    "role": {"type": "string"}, "index": {"type": "integer"}, "name": {"type": "string"},
    "state": {"type": "string"}, "reason": {"type": "string"},
    "restarts": {"type": "integer", "description": "how many times it was restarted"},
    "restart_history": {"type": "array", "items": RESTART, "description": "each restart: "
                        "which attempt ended, when and why; the replica's log has a line "
                        "`--- restart N of ROLE INDEX at HH:MM:SS: previous attempt … ---` "
                        "where the new attempt starts (locally)"},
    "exit_code": {"type": ["integer", "null"]},
    "devices": {"type": "array", "items": {"type": "integer"}},
    "usage": {"type": "array", "items": DEVICE_USAGE}}}
QUEUE_ENTRY = {"type": "object", "properties": {
    "id": {"type": "string"}, "user": {"type": "string"},
    "kind": {"type": "string", "enum": ["job", "notebook", "cluster"],
             "description": "cluster: a cluster held for a notebook (gpulab.cluster)"},
    "holder": {"type": "string"},
    "gpus": {"type": "integer"}, "position": {"type": ["integer", "null"]},
    "estimated_start": {"type": ["number", "null"], "description": "Unix time: the earliest "
                        "start from the time limits of running work and of the work ahead; "
                        "null: unknown (the reason says why, e.g. a notebook using the GPUs "
                        "has no time limit)"},
    "ahead": {"type": "integer"},
    "ahead_gpus": {"type": "integer"}, "waited_seconds": {"type": "number"},
    "held": {"type": "boolean"}, "preemptible": {"type": "boolean"},
    "reason": {"type": "string"}}}
JOB_NAME = {"name": "name", "in": "path", "required": True,
            "schema": {"type": "string", "minLength": 1, "maxLength": 64}}
AS_USER = {"name": "user", "in": "query", "required": False, "schema": {"type": "string"},
           "description": "another user's jobs (gpulab admins only)"}


def openapi_document(prefix: str = "/services/gpulab/") -> dict:
    quota_ops = {
        "get": {"summary": "Read a quota (admin)", "responses": _resp(QUOTA_OUT, 404)},
        "put": {"summary": "Set a quota (admin)",
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": QUOTA_IN}}},
                "responses": _resp(QUOTA_OUT, 400, 413)},
    }
    quota_ops["delete"] = {"summary": "Unset a quota (admin); without a default quota, only "
                           "free GPUs limit people without another quota",
                           "responses": _resp(None, 404, ok=204)}
    named = {**quota_ops, "parameters": [NAME]}
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpulab service", "version": "1",
                 "description": "GPU quotas, holdings and usage. Authenticate with a hub token "
                                "(`Authorization: token …`); admin operations need the scope "
                                "`custom:gpulab:admin`."},
        "servers": [{"url": prefix.rstrip("/") + "/api/v1"}],
        "components": {
            "securitySchemes": {"token": {"type": "apiKey", "in": "header", "name": "Authorization"}},
            "schemas": {"Error": {"type": "object", "required": ["status", "message"],
                                  "properties": {"status": {"type": "integer"},
                                                 "message": {"type": "string"},
                                                 "field": {"type": "string"}}},
                        "Replica": REPLICA, **_jobspec_schemas()},
        },
        "security": [{"token": []}],
        "paths": {
            "/me": {"get": {"summary": "My quota, holdings and usage", "responses": _resp({
                "type": "object", "properties": {
                    "user": {"type": "string"}, "groups": {"type": "array", "items": {"type": "string"}},
                    "quota": {"type": ["object", "null"]}, "quota_source": {"type": "string"},
                    "holdings": {"type": "array", "items": HOLDING},
                    "gpus_held": {"type": "integer"},
                    "usage_gpu_hours": {"type": "object"}, "inventory": {"type": "object"},
                    "admin": {"type": "boolean"},
                    "jobs": {"type": ["object", "null"], "description": "the job backend "
                             "(local or kubernetes) and the images a job may name",
                             "properties": {"backend": {"type": "string"},
                                            "images": {"type": "array",
                                                       "items": {"type": "string"}}}}}})}},
            "/quotas": {"get": {"summary": "All quotas set (admin), by scope and name",
                                "parameters": [OFFSET, _limit()],
                                "responses": _resp(_paged({
                "quotas": {"type": "array", "items": QUOTA_OUT}}), 400)}},
            "/quotas/effective": {"get": {
                "summary": "Every person's effective quota: their override, else the most "
                           "generous of their groups', else the default (admin); by name, "
                           "`q` keeps those whose name or group holds it (as the admin page)",
                "parameters": [{"name": "q", "in": "query", "required": False,
                                "schema": {"type": "string"}}, OFFSET, _limit()],
                "responses": _resp(_paged({"users": {
                    "type": "array", "items": {"type": "object", "properties": {
                        "name": {"type": "string"}, "quota": {"type": ["object", "null"]},
                        "quota_source": {"type": "string"},
                        "quota_text": {"type": "string"}}}}}), 400)}},
            "/quotas/default": quota_ops,
            "/quotas/users/{name}": named,
            "/quotas/groups/{name}": named,
            "/allocations": {"get": {
                "summary": "Current allocations (admin: everyone's; others: their own)",
                "parameters": [{"name": "user", "in": "query", "required": False,
                                "schema": {"type": "string"}}, OFFSET, _limit()],
                "responses": _resp(_paged({
                    "allocations": {"type": "array", "items": {"type": "object"}}}), 400)}},
            "/usage": {"get": {
                "summary": "GPU-hours per user and group over the last `days` days (a page of "
                           "each, by name; `total`: the longer of the two lists)",
                "parameters": [{"name": "days", "in": "query", "required": False,
                                "schema": {"type": "integer", "minimum": 1, "maximum": 366}},
                               OFFSET, _limit()],
                "responses": _resp(_paged({
                    "days": {"type": "integer"}, "users": {"type": "object"},
                    "groups": {"type": "object"}}), 400)}},
            "/audit": {"get": {
                "summary": "Quota changes, newest first, each also in words (`old_text`, "
                           "`new_text`) (admin)",
                "parameters": [OFFSET, _limit(100)],
                "responses": _resp(_paged({
                    "audit": {"type": "array", "items": {"type": "object"}}}), 400)}},
            "/idle": {"get": {
                "summary": "GPU-idle culling: my holdings' warnings, keeps and recent stops "
                           "(admins: ?user=)",
                "parameters": [AS_USER],
                "responses": _resp({"type": "object", "properties": {
                    "enabled": {"type": "boolean"},
                    "notices": {"type": "array", "items": {"type": "object"}},
                    "kept": {"type": "array", "items": {"type": "object"}},
                    "stopped": {"type": "array", "items": {"type": "object"}},
                    "keep_max_hours": {"type": "number"}}})}},
            "/servers/{name}/keep": {"post": {
                "summary": "Keep my server (``default``: the default one) from GPU-idle "
                           "culling for some hours, at most the hub's keep_max_hours "
                           "(admins: ?user=)",
                "parameters": [NAME, AS_USER],
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["hours"],
                    "properties": {"hours": {"type": "number", "exclusiveMinimum": 0}}}}}},
                "responses": _resp({"type": "object", "properties": {
                    "user": {"type": "string"}, "server": {"type": "string"},
                    "kept_until": {"type": "number"}, "hours": {"type": "number"},
                    "max_hours": {"type": "number"}}}, 400, 404, 409, 413)}},
            "/jobs": {
                "get": {"summary": "My jobs (admins: ?user= or ?all=1)",
                        "parameters": [AS_USER, {"name": "all", "in": "query", "required": False,
                                                 "schema": {"type": "string", "enum": ["1"]}},
                                       OFFSET, _limit()],
                        "responses": _resp(_paged({
                            "jobs": {"type": "array", "items": JOB}}), 400)},
                "post": {"summary": "Submit a training job: validated, admitted whole and "
                                    "started (201), or queued until its GPUs are free (202)",
                         "requestBody": {"required": True, "content": {"application/json": {
                             "schema": {"$ref": "#/components/schemas/JobSpec"}}}},
                         "responses": {**_resp(JOB, 400, 404, 413, ok=201),
                                       "202": {"description": "Queued: its view says where it "
                                               "stands", "content": {"application/json": {
                                                   "schema": JOB}}},
                                       "409": {"description": "Quota or GPUs refuse it, or the "
                                               "name is taken", "content": {"application/json": {
                                                   "schema": ERROR}}}}},
            },
            "/jobs/{name}": {"parameters": [JOB_NAME, AS_USER],
                             "get": {"summary": "A job: state, replicas, reasons",
                                     "responses": _resp(JOB, 404)}},
            "/jobs/{name}/stop": {"parameters": [JOB_NAME, AS_USER],
                                  "post": {"summary": "Stop a job (all replicas; GPUs released)",
                                           "responses": _resp(JOB, 404)}},
            "/jobs/{name}/lease": {
                "parameters": [JOB_NAME],
                "post": {"summary": "The notebook kernel holding my cluster renews its lease "
                                    "and says how long no step was dispatched",
                         "requestBody": {"required": False, "content": {"application/json": {
                             "schema": {"type": "object", "properties": {
                                 "idle_for": {"type": "number", "minimum": 0}}}}}},
                         "responses": _resp(JOB, 400, 404, 409)}},
            "/jobs/{name}/logs/{replica}": {
                "parameters": [JOB_NAME, {"name": "replica", "in": "path", "required": True,
                                          "schema": {"type": "string"}}, AS_USER,
                               {"name": "offset", "in": "query", "required": False,
                                "schema": {"type": "integer", "minimum": 0}},
                               {"name": "follow", "in": "query", "required": False,
                                "schema": {"type": "string", "enum": ["1"]}},
                               {"name": "raw", "in": "query", "required": False,
                                "schema": {"type": "string", "enum": ["1"]},
                                "description": "the bytes as the program wrote them (every "
                                "\\r and \\b redraw, escape sequences), from `offset`"}],
                "get": {"summary": "A replica's log from `offset`, as a terminal shows it; "
                                   "follow=1 waits for more",
                        "description": "`text` is what a terminal would show: each line in "
                        "its last state after `\\r` and `\\b` redraws (progress bars), "
                        "escape sequences and colours removed. It starts at `from`: the start "
                        "of the line that was still open (no newline yet) at `offset`, so a "
                        "reader replaces its own last, unfinished line with it (`from` < "
                        "`offset`) or appends it (`from` == `offset`). Ask next at the "
                        "answer's `offset`. With raw=1 `text` is the log as written, from "
                        "`offset`.",
                        "responses": _resp({"type": "object", "properties": {
                            "replica": {"type": "string"}, "text": {"type": "string"},
                            "offset": {"type": "integer"}, "from": {"type": "integer"},
                            "size": {"type": "integer"},
                            "done": {"type": "boolean"}}}, 400, 404, 409)}},
            "/queue": {"get": {
                "summary": "The GPU queue in the order of the line (admins: everyone's; others: "
                           "their own); enabled false where the hub has none",
                "parameters": [OFFSET, _limit()],
                "responses": _resp(_paged({
                    "enabled": {"type": "boolean"},
                    "entries": {"type": "array", "items": QUEUE_ENTRY}}), 400)}},
            "/queue/{id}/{action}": {
                "parameters": [{"name": "id", "in": "path", "required": True,
                                "schema": {"type": "string"}},
                               {"name": "action", "in": "path", "required": True,
                                "schema": {"type": "string",
                                           "enum": ["hold", "release", "top", "cancel"]}}],
                "post": {"summary": "Hold, release, move to the top or cancel a waiting entry "
                                    "(admin; audited; cancel stops a queued job); a person "
                                    "may cancel their own waiting notebook's entry (its start "
                                    "fails: 'You left the queue')",
                         "responses": _resp(QUEUE_ENTRY, 400, 404)}},
            "/openapi.json": {"get": {"summary": "This document", "security": [],
                                      "responses": {"200": {"description": "OK"}}}},
        },
    }
