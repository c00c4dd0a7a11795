"""KubeJobBackend on the test control plane: API requests per submit, time to Running against
creating the same objects directly, and status requests with 10 and 100 running jobs.

Runs in this process against a real control plane (tests/cluster: etcd, kube-apiserver,
scheduler, controller-manager, kwok with fake GPU nodes whose Job pods keep running), as the
hub's ServiceAccount bound by helm-values/rbac.yaml, with a SQLite quota ledger.

    python bench/k8s_jobs.py [--jobs 6] [--rounds 2] [--window 20] [--kueue]

With ``--kueue`` the control plane runs Kueue and JobSet too and the backend is
`KueueJobBackend` (``c.KubeJobBackend.kueue``): a job is one JobSet that Kueue admits; the
direct baseline creates the same JobSet (`make_training_jobset`, suspended, in the person's
LocalQueue) with the client, and step 2 also reports submit to admitted (the Workload's
Admitted condition, seen by the shared watch).

1. API requests per submit (shared watches excluded) of a parameter-server job (chief, 1 ps,
   2 workers of 1 H100: 3 roles) by a user whose namespace is prepared: goal <= roles + 3.
2. Median time from submit to every replica Running (seen by the shared pod watch), against
   creating the same objects (`make_training_job_objects`) directly with the client and
   waiting the same way: goal ratio <= 1.2.
3. API requests per minute while a client asks for the status of every job once a second,
   with 10 and then 100 running jobs: goal the same order (watching does not grow with jobs).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.cluster.controlplane import BUILD_SCRIPT, DEFAULT_STAGES, ControlPlane  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from k8s_spawn import RequestCounter, rbac_kubeconfig  # noqa: E402

PS_JOB = {"strategy": "parameter-server", "replicas": {"chief": 1, "ps": 1, "worker": 2},
          "resources": {"worker": {"gpus": 1}}, "script": "train.py"}
CPU_JOB = {"strategy": "multi-worker-mirrored", "replicas": {"worker": 1}, "script": "train.py"}


def running_stages(tmp: Path) -> Path:
    """kwok's default stages without the one that completes Job pods: replicas keep running."""
    docs = [d for d in yaml.safe_load_all(DEFAULT_STAGES.read_text())
            if d and d["metadata"]["name"] != "pod-job-done"]
    path = tmp / "stages.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


def all_running(backend, ns: str, name: str, replicas: int) -> bool:
    pods = [p for p in backend._pods_of(ns, name)
            if p.get("status", {}).get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")]
    return len(pods) == replicas


async def wait(check, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("replicas did not all run in time")
        await asyncio.sleep(0.02)


async def direct_create(backend, spec, ns: str, user: str) -> None:
    """The same objects, made directly: Service, then the role Jobs owned by it (with Kueue:
    the same JobSet, in the person's LocalQueue)."""
    from gpulab.hub.jobs.kubeobjects import (Placement, make_training_job_objects,
                                             make_training_jobset)

    where = Placement(namespace=ns, user_label=backend.user_label(user),
                      image=backend.image, program=f"/gpulab/shared/users/{user}/train.py",
                      job_dir=f"/gpulab/shared/users/{user}/jobs/{spec.name}",
                      user_dir=f"/gpulab/shared/users/{user}", gpu_model=backend.gpu_model)
    if getattr(backend, "launches_queued", False):
        from gpulab.hub.jobs.kueue import JOBSET

        await backend.custom.create_namespaced_custom_object(
            *JOBSET[:2], ns, JOBSET[2],
            make_training_jobset(spec, where, queue_name=backend.local_queue))
        return
    svc = await backend.core.create_namespaced_service(ns, make_training_job_objects(spec, where)[0])
    for job in make_training_job_objects(spec, where, parent_uid=svc.metadata.uid)[1:]:
        await backend.batch.create_namespaced_job(ns, job)


async def bench(args, kubeconfig: str, db: str) -> None:
    from kubernetes_asyncio.config import kube_config
    from traitlets.config import Config

    from gpulab.hub.jobs.spec import parse_spec
    from gpulab.hub.jobs.kube import KubeJobBackend
    from gpulab.hub.quota.ledger import Ledger
    from gpulab.hub.quota.policy import Quota

    kube_config.KUBE_CONFIG_DEFAULT_LOCATION = kubeconfig
    ledger = Ledger(f"sqlite:///{db}", pool="kubernetes")
    ledger.migrate()
    ledger.set_quota("default", "", Quota(max_gpus=1000), actor="bench")
    c = Config()
    c.KubeJobBackend.gpu_model = "NVIDIA-H100"
    c.KubeJobBackend.reconcile_interval = 0.2
    if args.kueue:
        from gpulab.hub.jobs.kueue import KueueJobBackend, workload_admitted

        backend = KueueJobBackend(ledger, config=c)
    else:
        backend = KubeJobBackend(ledger, config=c)
    label = "KueueJobBackend" if args.kueue else "KubeJobBackend"

    def admitted(name: str) -> bool:
        js = backend._jobsets_r.resources.get(f"{ns}/{name}")
        return js is not None and workload_admitted(backend._workload_of(js))

    # 100 running jobs of one person measure status reads, not the operator's replica bound
    backend.limits = dataclasses.replace(backend.limits, max_replicas_per_user=0)
    backend.ensure_supervisor()
    await backend.start_watches()
    counter = RequestCounter()
    user = f"b{uuid.uuid4().hex[:6]}"
    ns = backend.namespace_of(user)
    n_replicas = 4

    # warm up: the user's namespace and quota, the node list, the clients
    first = counter.n
    await backend.submit(user, (), parse_spec({"name": "warm", **PS_JOB}))
    first = counter.n - first
    await wait(lambda: all_running(backend, ns, "warm", n_replicas))
    await backend.stop(user, "warm")

    times: dict[str, list[float]] = {"direct": [], "gpulab": []}
    to_admitted: dict[str, list[float]] = {"direct": [], "gpulab": []}
    requests: list[int] = []
    k = 0
    for r in range(args.rounds):
        for kind in (("direct", "gpulab") if r % 2 == 0 else ("gpulab", "direct")):
            for _ in range(args.jobs):
                k += 1
                name = f"{kind[0]}{k}"
                spec = parse_spec({"name": name, **PS_JOB})
                before = counter.n
                t0 = time.perf_counter()
                if kind == "gpulab":
                    await backend.submit(user, (), spec)
                    requests.append(counter.n - before)
                else:
                    await direct_create(backend, spec, ns, user)
                if args.kueue:
                    await wait(lambda: admitted(name))
                    to_admitted[kind].append(time.perf_counter() - t0)
                await wait(lambda: all_running(backend, ns, name, n_replicas))
                times[kind].append(time.perf_counter() - t0)
                if kind == "gpulab":
                    await backend.stop(user, name)
                else:
                    await backend._delete_parent(ns, name)
                await wait(lambda: not backend._pods_of(ns, name))  # GPUs free for the next

    # status with 10, then 100 running jobs
    per_minute = {}
    made = 0
    for target in (10, 100):
        while made < target:
            made += 1
            await backend.submit(user, (), parse_spec({"name": f"s{made}", **CPU_JOB}))
        await wait(lambda: all(all_running(backend, ns, f"s{i}", 1) for i in range(1, made + 1)),
                   timeout=300)
        await wait(lambda: all(j["state"] == "Running" for j in backend.list(user)
                               if j["name"].startswith("s")), timeout=60)
        before = counter.n
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.window:
            for j in backend.list(user):  # what the jobs API answers, once a second
                backend.get(user, j["name"])
            await asyncio.sleep(1)
        per_minute[target] = (counter.n - before) * 60 / (time.monotonic() - t0)
    for i in range(1, made + 1):
        await backend.stop(user, f"s{i}")
    await backend.shutdown()

    med = {k: statistics.median(v) for k, v in times.items()}
    goal = "JobSet + NetworkPolicy: 2" if args.kueue else "<= 3 + 3"
    print(f"API requests per submit (3 roles): first job of a user {first}, then median "
          f"{statistics.median(requests):.0f} (goal {goal})")
    if args.kueue:
        adm = {k: statistics.median(v) for k, v in to_admitted.items()}
        print(f"median submit to admitted by Kueue: direct JobSet {adm['direct'] * 1000:.0f} ms, "
              f"{label} {adm['gpulab'] * 1000:.0f} ms (ratio {adm['gpulab'] / adm['direct']:.2f})")
    print(f"median submit to all {n_replicas} replicas Running: direct objects "
          f"{med['direct'] * 1000:.0f} ms, {label} {med['gpulab'] * 1000:.0f} ms "
          f"({len(times['direct'])} jobs each)")
    print(f"ratio {label} / direct: {med['gpulab'] / med['direct']:.2f} (goal <= 1.2)")
    print(f"API requests per minute for status: 10 jobs {per_minute[10]:.1f}, 100 jobs "
          f"{per_minute[100]:.1f} (goal: the same order; shared watches only)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=6, help="jobs per configuration and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window", type=float, default=20, help="seconds of status reads")
    parser.add_argument("--kueue", action="store_true",
                        help="jobs as JobSets admitted by Kueue (KueueJobBackend)")
    args = parser.parse_args()
    subprocess.run(["bash", str(BUILD_SCRIPT), "--quiet"], check=True)
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-") as tmp:
        with ControlPlane(kwok_stages=[running_stages(Path(tmp))], queueing=args.kueue) as cp:
            print(f"control plane up in {cp.startup_seconds:.1f}s")
            asyncio.run(bench(args, rbac_kubeconfig(cp), str(Path(tmp) / "gpulab.sqlite")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
