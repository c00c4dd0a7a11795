"""The Kubernetes objects of a cluster (``kind: cluster``, issue 38: parameter servers and
workers held for the person's notebook kernel), as literal dicts: its JobSet, its Indexed Jobs
(without Kueue), its NetworkPolicies, and the addresses its view gives the kernel."""

import json

import pytest

from gpulab.hub.jobs.kube import KubeJobBackend, cluster_failure_words
from gpulab.hub.jobs.kubeobjects import (
    CLUSTER_PROGRAM,
    REPLICA_COMMAND,
    Placement,
    make_cluster_coordinator_policy,
    make_job_network_policy,
    make_training_job_objects,
    make_training_jobset,
)
from gpulab.hub.jobs.kueue import backend_from_settings
from gpulab.hub.jobs.spec import parse_spec
from gpulab.hub.quota.ledger import Ledger
from tests.cluster.kubelet import expand as kubelet_expand

CLUSTER = {"name": "held", "kind": "cluster", "strategy": "parameter-server",
           "replicas": {"ps": 2, "worker": 3}, "resources": {"worker": {"gpus": 1}},
           "retries": 4, "max_runtime": 7200}
NS = "gpulab-ann"
LABELS = {"app.kubernetes.io/managed-by": "gpulab", "app.kubernetes.io/component": "training-job",
          "gpulab.io/user": "ann", "gpulab.io/job": "held"}
REPLICAS = {"matchLabels": {"gpulab.io/user": "ann", "gpulab.io/job": "held"}}
NOTEBOOKS = {"matchLabels": {"component": "singleuser-server"}}
JOBSET_HOSTS = {
    "ps": ["held-ps-0-0.held.gpulab-ann.svc:2222", "held-ps-0-1.held.gpulab-ann.svc:2222"],
    "worker": [f"held-worker-0-{i}.held.gpulab-ann.svc:2222" for i in range(3)],
}
OWNER = [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": "held",
          "uid": "uid-1"}]


def placement() -> Placement:
    return Placement(namespace=NS, user_label="ann", image="gpulab/singleuser:1",
                     program=CLUSTER_PROGRAM, job_dir="/gpulab/shared/users/ann/jobs/held",
                     user_dir="/gpulab/shared/users/ann")


def jobset() -> dict:
    return make_training_jobset(parse_spec(CLUSTER), placement(), queue_name="gpulab")


def test_a_cluster_is_a_jobset_of_ps_and_workers_that_kueue_admits_whole():
    js = jobset()
    assert js["metadata"] == {"name": "held", "namespace": NS,
                              "labels": {**LABELS, "kueue.x-k8s.io/queue-name": "gpulab"}}
    spec = js["spec"]
    assert spec["suspend"] is True  # Kueue unsuspends it once all 3 GPUs are admitted
    assert [(r["name"], r["replicas"], r["template"]["spec"]["parallelism"])
            for r in spec["replicatedJobs"]] == [("ps", 1, 2), ("worker", 1, 3)]
    # servers end only when the cluster is stopped; a lost ps ends the cluster, never a restart
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["ps", "worker"]}
    assert spec["failurePolicy"] == {"maxRestarts": 0, "rules": [
        {"name": "lostParameterServer", "action": "FailJobSet", "targetReplicatedJobs": ["ps"]},
        {"name": "replicaFailed", "action": "FailJobSet"}]}


def test_workers_are_restartable_and_parameter_servers_are_not():
    jobs = {r["name"]: r["template"]["spec"] for r in jobset()["spec"]["replicatedJobs"]}
    worker, ps = jobs["worker"], jobs["ps"]
    # a lost worker pod: the Job controller makes a new one with the same host name
    assert worker["backoffLimit"] == 4 and worker["podReplacementPolicy"] == "Failed"
    assert worker["podFailurePolicy"]["rules"][0]["action"] == "Ignore"  # evicted: no count
    assert worker["activeDeadlineSeconds"] == 7200
    assert ps["backoffLimit"] == 0 and "podFailurePolicy" not in ps
    for job in (worker, ps):
        assert job["completionMode"] == "Indexed"
        assert job["template"]["spec"]["restartPolicy"] == "Never"


def test_every_replica_serves_its_tf_config_task_and_runs_no_code():
    for rj in jobset()["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["command"] == [*REPLICA_COMMAND, CLUSTER_PROGRAM]
        assert "volumes" not in pod  # no code ConfigMap, no shared storage asked here
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["GPULAB_KIND"] == "cluster" and env["GPULAB_STRATEGY"] == "parameter-server"
        env["GPULAB_TASK_INDEX"] = "1"
        tf_config = json.loads(kubelet_expand(env["TF_CONFIG"], env))
        assert tf_config == {"cluster": JOBSET_HOSTS, "task": {"type": rj["name"], "index": 1}}
        assert c["ports"] == [{"name": "tf", "containerPort": 2222}]
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == ("1" if rj["name"] == "worker" else None)


def test_a_job_gets_no_kind_variable():
    job = {"name": "j", "strategy": "multi-worker-mirrored", "script": "t.py"}
    js = make_training_jobset(parse_spec(job), placement(), queue_name=None)
    env = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "GPULAB_KIND" not in {e["name"] for e in env}


def test_without_kueue_a_cluster_is_its_indexed_jobs_under_the_headless_service():
    objs = make_training_job_objects(parse_spec(CLUSTER), placement(), parent_uid="uid-s")
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("Service", "held"), ("Job", "held-ps"), ("Job", "held-worker")]
    ps, worker = objs[1]["spec"], objs[2]["spec"]
    assert ps["backoffLimit"] == 0 and worker["backoffLimit"] == 4
    env = {e["name"]: e.get("value") for e in worker["template"]["spec"]["containers"][0]["env"]}
    assert env["GPULAB_KIND"] == "cluster"
    assert json.loads(env["TF_CONFIG"].replace("$(GPULAB_TASK_INDEX)", "0"))["cluster"] == {
        "ps": ["held-ps-0.held.gpulab-ann.svc:2222", "held-ps-1.held.gpulab-ann.svc:2222"],
        "worker": [f"held-worker-{i}.held.gpulab-ann.svc:2222" for i in range(3)]}


def test_a_clusters_replicas_accept_their_peers_and_the_namespaces_notebooks_on_the_tf_port():
    assert make_job_network_policy(job="held", namespace=NS, user_label="ann", parent_uid="uid-1",
                                   parent=("jobset.x-k8s.io/v1alpha2", "JobSet"),
                                   coordinator="singleuser-server") == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "held-replicas", "namespace": NS, "labels": LABELS,
                     "ownerReferences": OWNER},
        "spec": {"podSelector": REPLICAS, "policyTypes": ["Ingress", "Egress"],
                 "ingress": [{"from": [{"podSelector": REPLICAS}]},
                             {"from": [{"podSelector": NOTEBOOKS}],
                              "ports": [{"protocol": "TCP", "port": 2222}]}],
                 "egress": [{"to": [{"podSelector": REPLICAS}]}]},
    }


def test_the_namespaces_notebooks_may_open_connections_to_the_cluster_on_the_tf_port_only():
    assert make_cluster_coordinator_policy(job="held", namespace=NS, user_label="ann",
                                           coordinator="singleuser-server", parent_uid="uid-1") == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "held-coordinator", "namespace": NS, "labels": LABELS,
                     "ownerReferences": OWNER},
        "spec": {"podSelector": NOTEBOOKS, "policyTypes": ["Egress"],
                 "egress": [{"to": [{"podSelector": REPLICAS}],
                             "ports": [{"protocol": "TCP", "port": 2222}]}]},
    }


@pytest.mark.parametrize("kueue, host", [
    (True, "held-{role}-0-{i}.held.gpulab-ann.svc:2222"),
    (False, "held-{role}-{i}.held.gpulab-ann.svc:2222"),
], ids=["jobset", "indexed-jobs"])
def test_the_backends_policies_and_addresses_of_a_cluster(tmp_path, kueue, host):
    backend = backend_from_settings(Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}"), json.dumps(
        {"kueue": kueue, "server_component": "notebook"}))
    assert isinstance(backend, KubeJobBackend)
    spec = parse_spec(CLUSTER)
    assert backend.cluster_addresses("ann", spec) == {
        role: [host.format(role=role, i=i) for i in range(n)] for role, n in (("ps", 2), ("worker", 3))}
    policies = backend.network_policies("ann", spec, NS, "uid-1", ("v1", "Service"))
    assert [p["metadata"]["name"] for p in policies] == ["held-replicas", "held-coordinator"]
    assert policies[1]["spec"]["podSelector"] == {"matchLabels": {"component": "notebook"}}
    job = parse_spec({"name": "j", "strategy": "multi-worker-mirrored", "script": "t.py"})
    (only,) = backend.network_policies("ann", job, NS, None, ("v1", "Service"))
    assert len(only["spec"]["ingress"]) == 1  # a job's replicas: their peers only


def test_a_lost_parameter_server_is_said_with_what_to_do():
    states = {("ps", 0): ("Running", "", None, 0), ("ps", 1): ("Failed", "exited 137", 137, 0),
              ("worker", 0): ("Running", "", None, 0)}
    words = cluster_failure_words(states, "jobset failed")
    assert words.startswith("parameter server ps-1 was lost (exited 137)")
    assert "last checkpoint" in words and "new cluster" in words
    states[("ps", 1)] = ("Running", "", None, 0)
    assert cluster_failure_words(states, "jobset failed") == "jobset failed"


def test_only_the_owners_notebook_pods_reach_the_clusters_servers():
    """What the policies let through (`tests.cluster.netpol`, the NetworkPolicy semantics):
    Ann's notebook pods reach her cluster's servers on the TF port only; her cluster's
    servers reach each other; nobody else gets in (Bob's notebook, Bob's job, Ann's own
    training job, a pod of a namespace gpulab does not manage even labelled as a notebook),
    and the servers open nothing to her notebook."""
    from gpulab.hub.cluster.kubeobjects import make_user_network_policies
    from tests.cluster.netpol import Endpoint, allowed

    def person(who, *, clusters=(), jobs=()):
        ns = f"gpulab-{who}"
        out = make_user_network_policies(namespace=ns, user_label=who, hub_namespace="gpulab")
        for name in clusters:
            out.append(make_job_network_policy(job=name, namespace=ns, user_label=who,
                                               coordinator="singleuser-server"))
            out.append(make_cluster_coordinator_policy(job=name, namespace=ns, user_label=who,
                                                       coordinator="singleuser-server"))
        for name in jobs:
            out.append(make_job_network_policy(job=name, namespace=ns, user_label=who))
        return out

    policies = [*person("ann", clusters=["held"], jobs=["digits"]), *person("bob", jobs=["x"])]

    def replica(who, job):
        return Endpoint.pod(f"gpulab-{who}", **{"gpulab.io/user": who, "gpulab.io/job": job})

    ps, worker = replica("ann", "held"), replica("ann", "held")
    notebook = Endpoint.pod("gpulab-ann", component="singleuser-server")
    assert allowed(policies, notebook, ps, 2222) and allowed(policies, notebook, worker, 2222)
    assert not allowed(policies, notebook, ps, 8888)  # the TF port only
    assert allowed(policies, worker, ps, 2222)
    assert not allowed(policies, ps, notebook, 8888)
    assert not allowed(policies, notebook, replica("ann", "digits"), 2222)  # her jobs stay shut
    intruders = {
        "bob's notebook": Endpoint.pod("gpulab-bob", component="singleuser-server"),
        "bob's job": replica("bob", "x"),
        "ann's own job": replica("ann", "digits"),
        "another team's pod": Endpoint.pod("team-eve", component="singleuser-server",
                                           **{"gpulab.io/user": "ann", "gpulab.io/job": "held"}),
    }
    for name, who in intruders.items():
        assert not allowed(policies, who, ps, 2222), name
