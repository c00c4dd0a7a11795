"""Spawn time and API requests per spawn: KubeGPUSpawner against stock KubeSpawner.

Both run in this process against the same real control plane (tests/cluster: etcd,
kube-apiserver, scheduler, controller-manager, kwok with fake GPU nodes), as the same
ServiceAccount bound by helm-values/rbac.yaml, with the same profile (1 H100 GPU), user
namespaces enabled and no home volume (the test cluster has no storage provisioner). The stock
configuration adds the GPU toleration itself, as an admin would; KubeGPUSpawner also admits the
GPU through the quota ledger (SQLite) and writes the user's namespace labels and ResourceQuota.

    python bench/k8s_spawn.py [--spawns 8] [--rounds 2]

Each spawn is a new user (a new namespace). Prints the median time from start() to the server's
address for each, their ratio (goal <= 1.10), and the API requests each spawn made (shared
watches excluded; goal: at most 3 more than stock). Rounds alternate the two configurations.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.cluster.controlplane import BUILD_SCRIPT, GPU_TOLERATION, ControlPlane  # noqa: E402

PROFILE = [{
    "display_name": "1 H100", "slug": "h100-1", "default": True,
    "kubespawner_override": {
        "extra_resource_limits": {"nvidia.com/gpu": "1"},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
    },
}]


class RequestCounter:
    """Counts the Kubernetes client's requests, watches excluded."""

    def __init__(self):
        from kubernetes_asyncio.client import rest

        self.n = 0
        original = rest.RESTClientObject.request
        counter = self

        async def counted(self, method, url, query_params=None, *args, **kwargs):
            if not any(k == "watch" and str(v).lower() == "true" for k, v in (query_params or [])):
                counter.n += 1
            return await original(self, method, url, query_params, *args, **kwargs)

        rest.RESTClientObject.request = counted


def rbac_kubeconfig(cp: ControlPlane) -> str:
    cp.create_namespace("gpulab-bench-hub")
    docs = list(yaml.safe_load_all((ROOT / "helm-values" / "rbac.yaml").read_text()))
    for d in docs:
        for s in d.get("subjects", []):
            s["namespace"] = "gpulab-bench-hub"
    cp.apply(*docs)
    return cp.service_account_kubeconfig("gpulab-bench-hub", "hub")


def make_spawner(kind: str, config):
    from jupyterhub.objects import Hub
    from kubespawner import KubeSpawner

    from gpulab.spawner.kube import KubeGPUSpawner

    name = f"b{uuid.uuid4().hex[:8]}"
    user = SimpleNamespace(name=name, id=1, url=f"/user/{name}/", groups=[])
    cls = KubeGPUSpawner if kind == "gpulab" else KubeSpawner
    s = cls(config=config, user=user, hub=Hub(), api_token="not-a-token",
            oauth_client_id=f"jupyterhub-user-{name}")
    s.user_options = {"profile": "h100-1"}
    return s


async def one_spawn(kind, config, counter) -> tuple[float, int]:
    s = make_spawner(kind, config)
    before = counter.n
    t0 = time.perf_counter()
    await asyncio.wait_for(s.start(), 120)
    elapsed = time.perf_counter() - t0
    requests = counter.n - before
    await s.stop(now=True)
    s.clear_state()
    return elapsed, requests


async def bench(args, kubeconfig: str, db: str) -> None:
    from kubernetes_asyncio.config import kube_config
    from kubespawner import KubeSpawner
    from traitlets.config import Config

    from gpulab.hub.quota.policy import Quota
    from gpulab.spawner.mixin import hub_ledger

    kube_config.KUBE_CONFIG_DEFAULT_LOCATION = kubeconfig
    c = Config()
    c.GPULedger.db_url = f"sqlite:///{db}"
    c.GPULedger.pool = "kubernetes"
    for cls in ("KubeSpawner", "KubeGPUSpawner"):
        c[cls].profile_list = PROFILE
        c[cls].enable_user_namespaces = True
        c[cls].user_namespace_template = "bench-{username}"
        c[cls].storage_pvc_ensure = False
        c[cls].start_timeout = 120
    c.KubeSpawner.tolerations = [GPU_TOLERATION]  # the stock spawner needs it said
    hub_ledger(c, assigns_devices=False).set_quota("default", "", Quota(max_gpus=8), actor="bench")
    counter = RequestCounter()
    for kind in ("stock", "gpulab"):  # warm up: shared watches, clients, the ledger
        await one_spawn(kind, c, counter)
    results: dict[str, list[tuple[float, int]]] = {"stock": [], "gpulab": []}
    for r in range(args.rounds):
        order = ("stock", "gpulab") if r % 2 == 0 else ("gpulab", "stock")
        for kind in order:
            for _ in range(args.spawns):
                results[kind].append(await one_spawn(kind, c, counter))
    await KubeSpawner._stop_all_reflectors()

    med = {k: statistics.median(t for t, _ in v) for k, v in results.items()}
    req = {k: statistics.median(n for _, n in v) for k, v in results.items()}
    n = len(results["stock"])
    print(f"spawns per configuration: {n} ({args.rounds} rounds of {args.spawns})")
    print(f"median spawn time: stock KubeSpawner {med['stock'] * 1000:.0f} ms, "
          f"KubeGPUSpawner {med['gpulab'] * 1000:.0f} ms")
    print(f"ratio KubeGPUSpawner / stock: {med['gpulab'] / med['stock']:.2f} (goal <= 1.10)")
    print(f"API requests per spawn: stock {req['stock']:.0f}, KubeGPUSpawner {req['gpulab']:.0f}, "
          f"extra {req['gpulab'] - req['stock']:+.0f} (goal <= +3)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spawns", type=int, default=8, help="spawns per configuration and round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    subprocess.run(["bash", str(BUILD_SCRIPT), "--quiet"], check=True)
    with ControlPlane() as cp, tempfile.TemporaryDirectory(prefix="gpulab-bench-") as tmp:
        print(f"control plane up in {cp.startup_seconds:.1f}s")
        asyncio.run(bench(args, rbac_kubeconfig(cp), str(Path(tmp) / "gpulab.sqlite")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
