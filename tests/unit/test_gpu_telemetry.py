"""GPU telemetry's sources and GPU-idle culling's policy (issue 39, items 2 and 3).

- the DCGM exporter's page (`tests/data/dcgm-exporter.prom`, dcgm-exporter 3.3's text format
  with its Kubernetes mapping) parsed into per-GPU figures, each labelled by the pod owner;
- the stand-in source (a JSON file only its owner may write) driving simulated GPUs;
- `IdleTracker`, the policy: warned, then stopped; busy resets; unmeasured is never culled;
  "keep" holds it off; rules by group, profile and kind.
"""

import json
import os
from pathlib import Path

import pytest

from gpulab.hub.machine.gpuusage import (DcgmSource, PoolUsage, Readings, StandInSource,
                                         UsageSampler, UsageSource, device_usage, parse_dcgm,
                                         pod_owner, usage_source)
from gpulab.hub.quota.idle import (BadIdleRule, GPUIdle, IdleRule, IdleSettings, IdleTracker,
                                   make_rule)
from gpulab.hub.quota.ledger import Allocation, DeviceInfo

PAGE = (Path(__file__).parents[1] / "data" / "dcgm-exporter.prom").read_text()


def alloc(id, user, kind, holder, gpus=1, devices=()):
    return Allocation(id, "kubernetes", kind, holder, user, gpus, None, tuple(devices), 0.0)


def test_the_dcgm_page_gives_each_gpu_its_use_memory_and_pod():
    gpus = {(u.pod, u.gpu): u for u in parse_dcgm(PAGE, now=5.0)}
    assert len(gpus) == 5  # other counters (clocks, power, XID…) are not GPUs of their own
    ann = gpus[("jupyter-ann", 0)]
    assert (ann.gpu_percent, ann.memory_used_mib, ann.memory_total_mib) == (0, 1203, 81254)
    assert (ann.namespace, ann.uuid, ann.source, ann.at) == (
        "gpulab-ann", "GPU-6c1a3b8e-2f4d-4a8b-9e51-0d7c3f2a9b11", "dcgm", 5.0)
    assert gpus[("digits-worker-0-1-q9m4z", 2)].gpu_percent == 91
    assert gpus[("", 1)].namespace == ""  # a GPU no pod holds


def test_dcgm_lines_that_are_not_samples_are_skipped():
    text = ('# HELP x\nnot a sample\nDCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-q",pod="a\\"b"} 12\n'
            'DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-r"} NaNx\n'
            'DCGM_FI_DEV_FB_USED{gpu="2",UUID="GPU-s"} 7\n')
    found = parse_dcgm(text)
    assert [(u.uuid, u.gpu_percent, u.pod) for u in found] == [("GPU-q", 12, 'a"b')]


def test_each_dcgm_gpu_is_labelled_by_its_pods_owner():
    allocs = [alloc("n1", "ann", "notebook", "default"), alloc("j1", "bob", "job", "digits", 2),
              alloc("n2", "carl", "notebook", "big"), alloc("n3", "carl", "notebook", "default")]
    owners = {(u.pod, u.gpu): getattr(pod_owner(u, allocs), "id", None) for u in parse_dcgm(PAGE)}
    assert owners == {("jupyter-ann", 0): "n1", ("digits-worker-0-0-x7k2p", 1): "j1",
                      ("digits-worker-0-1-q9m4z", 2): "j1", ("jupyter-carl--big", 0): "n2",
                      ("", 1): None}
    # job "digits" does not take the pods of bob's job "digits-big"
    from gpulab.hub.machine.gpuusage import Usage
    big = Usage("GPU-x", 50, 1, 2, 0.0, "dcgm", 0, "digits-big-worker-0-0-abcde", "gpulab-bob")
    assert pod_owner(big, allocs + [alloc("j2", "bob", "job", "digits-big")]).id == "j2"
    assert pod_owner(big, allocs) is None
    # the namespace must be the person's: bob's pod name in ann's namespace is not bob's
    [u] = [u for u in parse_dcgm(PAGE) if u.pod == "jupyter-ann"]
    assert pod_owner(u, [alloc("x", "eve", "notebook", "default")]) is None


class PageSource(UsageSource):
    """A DCGM source that reads the recorded page instead of the network."""

    name = "dcgm"

    def read(self):
        found = parse_dcgm(PAGE)
        return Readings(by_uuid={u.uuid: u for u in found}, pods=tuple(found))


def test_a_counting_pool_shows_each_holdings_gpus_from_dcgm():
    usage = PoolUsage([], 0.05, source=PageSource())
    try:
        assert usage.sampler.wait_first(5)
        allocs = [alloc("n1", "ann", "notebook", "default"), alloc("j1", "bob", "job", "digits", 2)]
        job = usage.entries_for(allocs[1], allocs)
        assert [e["text"] for e in job] == ["GPU 1: 87% busy, 60.0 of 79.3 GiB",
                                            "GPU 2: 91% busy, 58.8 of 79.3 GiB"]
        assert {e["pod"] for e in job} == {"digits-worker-0-0-x7k2p", "digits-worker-0-1-q9m4z"}
        assert usage.entries_for(allocs[0], allocs)[0]["gpu_percent"] == 0
        # the culler's round: every holding at once, the same figures
        assert usage.by_allocation(allocs) == {a.id: usage.entries_for(a, allocs) for a in allocs}
    finally:
        usage.close()


def test_the_dcgm_source_reads_the_exporter_over_http():
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        src = usage_source({"source": "dcgm",
                            "dcgm_url": f"http://127.0.0.1:{server.server_port}/metrics"})
        assert isinstance(src, DcgmSource)
        assert len(src.read().pods) == 5
        src.url = "http://127.0.0.1:1/metrics"  # nobody there: no figures, no exception
        assert src.read().pods == ()
    finally:
        server.shutdown()
        server.server_close()


def test_the_stand_in_file_drives_simulated_gpus(tmp_path):
    path = tmp_path / "gpu-usage.json"
    path.write_text(json.dumps({"0": {"gpu_percent": 2, "memory_used_mib": 512,
                                      "memory_total_mib": 16384}}))
    os.chmod(path, 0o600)
    devices = [DeviceInfo(0, "sim-0", simulated=True), DeviceInfo(1, "sim-1", simulated=True)]
    usage = PoolUsage(devices, 0.05, source=StandInSource(path))
    try:
        usage.sampler.wait_first(0.3)
        for _ in range(100):
            if usage.readings().by_index:
                break
            import time
            time.sleep(0.02)
        zero, one = usage.entries([0, 1])
        assert zero["text"] == "GPU 0: 2% busy, 0.5 of 16.0 GiB (stand-in figures, simulated GPU)"
        assert (zero["source"], zero["simulated"]) == ("stand-in", True)
        assert (one["measured"], one["why"]) == (False, "simulated")
    finally:
        usage.close()


@pytest.mark.parametrize("how", ["others-write", "link", "missing", "garbage"])
def test_a_stand_in_file_others_could_write_is_not_read(tmp_path, how):
    real = tmp_path / "real.json"
    real.write_text('{"0": {"gpu_percent": 50}}')
    os.chmod(real, 0o600)
    path = tmp_path / "gpu-usage.json"
    if how == "others-write":
        path.write_text('{"0": {"gpu_percent": 50}}')
        os.chmod(path, 0o622)
    elif how == "link":
        path.symlink_to(real)
    elif how == "garbage":
        path.write_text('["not", "a", "map"]')
        os.chmod(path, 0o600)
    assert StandInSource(path).read().by_index == {}
    assert StandInSource(real).read().by_index[0].gpu_percent == 50


def test_nvml_stays_the_default_and_simulated_gpus_say_so():
    assert usage_source({}) is None and usage_source({"source": "nvml"}) is None
    entry = device_usage(3, "sim", True, {})
    assert (entry["measured"], entry["text"]) == (False, "GPU 3: simulated (nothing to measure)")
    # a source that fails to open leaves the sampler empty and says it is not available
    class Closed(UsageSource):
        def open(self):
            return False
    s = UsageSampler((), 0.05, source=Closed())
    s.start()
    s._thread.join(2)
    assert not s.available and s.snapshot() == {}


# -- the policy

STOP = IdleRule(mode="stop", threshold_percent=5, idle_seconds=100, warn_seconds=30)


def test_an_idle_holding_is_warned_then_stopped_not_sooner_than_the_warning_says():
    t = IdleTracker()
    assert t.observe("a", False, STOP, 0) is None          # idle from 0
    assert t.observe("a", False, STOP, 69) is None
    warn = t.observe("a", False, STOP, 70)                  # 100 - 30
    assert (warn.what, warn.idle_since, warn.stop_at) == ("warn", 0, 100)
    assert t.observe("a", False, STOP, 99) is None
    stop = t.observe("a", False, STOP, 100)
    assert stop.what == "stop"


def test_use_resets_the_clock_and_unmeasured_gpus_are_never_culled():
    t = IdleTracker()
    t.observe("a", False, STOP, 0)
    assert t.observe("a", False, STOP, 80).what == "warn"
    assert t.observe("a", True, STOP, 90) is None           # used again: warning withdrawn
    assert t.observe("a", False, STOP, 95) is None
    assert t.observe("a", False, STOP, 165).what == "warn"  # 70 s after it went idle again
    for now in range(0, 1000, 50):
        assert t.observe("b", None, STOP, now) is None
    # a warning that came late still gives its full notice
    late = IdleTracker()
    late.observe("c", False, STOP, 0)
    assert late.observe("c", False, STOP, 500).stop_at == 530


def test_keep_holds_off_until_it_ends_and_the_clock_starts_again():
    t = IdleTracker()
    t.observe("a", False, STOP, 0)
    t.keep("a", until=1000)
    for now in (100, 500, 999):
        assert t.observe("a", False, STOP, now) is None
    assert t.observe("a", False, STOP, 1000) is None        # idle from the keep's end
    assert t.observe("a", False, STOP, 1070).what == "warn"


def test_warn_mode_warns_once_and_never_stops():
    rule = IdleRule(mode="warn", idle_seconds=10)
    t = IdleTracker()
    t.observe("a", False, rule, 0)
    assert t.observe("a", False, rule, 10).what == "warn"
    assert all(t.observe("a", False, rule, n) is None for n in range(11, 500, 7))


def test_rules_by_group_profile_and_kind_first_match_wins():
    base = make_rule(IdleRule(), {"mode": "stop", "idle_seconds": 3600})
    s = IdleSettings(base, (make_rule(base, {"groups": ["interactive"], "mode": "warn"}),
                            make_rule(base, {"profiles": ["gpu-big"], "idle_seconds": 600}),
                            make_rule(base, {"kinds": ["job"], "mode": "off"})), 4)
    assert s.rule_for("notebook", ["interactive", "x"], "gpu-big").mode == "warn"
    assert s.rule_for("notebook", [], "gpu-big").idle_seconds == 600
    assert s.rule_for("job", [], None).mode == "off"
    assert s.rule_for("notebook", [], "gpu-1") is base
    again = IdleSettings.from_json(s.to_json())
    assert again == s and again.active


@pytest.mark.parametrize("raw, words", [
    ({"mode": "kill"}, "mode must be one of"),
    ({"idle_minutes": 3}, "unknown key"),
    ({"idle_seconds": 0}, "idle_seconds > 0"),
])
def test_bad_rules_are_refused_with_words(raw, words):
    with pytest.raises(BadIdleRule, match=words):
        GPUIdle(rules=[raw]).settings()


def test_culling_is_off_by_default():
    s = GPUIdle().settings()
    assert not s.active and s.keep_max_hours == 8
    assert IdleSettings.from_json("") == IdleSettings()


@pytest.mark.parametrize("pod, expected", [
    ("digits-worker-0-0-x7k2p", ("worker", 0)),   # a JobSet's pod: job index, then pod index
    ("digits-worker-1-q9m4z", ("worker", 1)),     # an Indexed Job's pod
    ("digits-chief-0-0-abcde", ("chief", 0)),
    ("digits2-worker-0-1-zzzzz", None),           # another job whose name starts the same
    ("jupyter-ann", None),
])
def test_a_replica_pod_names_its_role_and_index(pod, expected):
    from gpulab.hub.service.jobs import replica_of_pod

    assert replica_of_pod("digits", pod) == expected


def test_the_replica_roles_are_the_contracts():
    # gpuusage keeps its own copy (the GPU checks load it without gpulab installed)
    from gpulab.extensions.contract import ROLES
    from gpulab.hub.machine.gpuusage import REPLICA_ROLES

    assert REPLICA_ROLES == ROLES



# -- the service's rounds (a real ledger; the hub and the job backend are doubles)

async def test_a_round_warns_then_stops_by_the_rule_of_each_holdings_group_and_profile(tmp_path):
    from gpulab.hub.quota.ledger import Ledger, Request
    from gpulab.hub.service.idle import IdleCuller
    from tests.doubles import FakeHubDirectory, FakeJobs

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.migrate()
    ledger.sync_inventory([DeviceInfo(i, f"sim-{i}", simulated=True) for i in range(4)])
    nb_ann = ledger.admit(Request("ann", "notebook", "default", 1))
    nb_bob = ledger.admit(Request("bob", "notebook", "big", 1))
    nb_cy = ledger.admit(Request("cy", "notebook", "default", 1))
    job = ledger.admit(Request("ann", "job", "digits", 1))
    path = tmp_path / "gpu-usage.json"
    path.write_text(json.dumps({str(i): {"gpu_percent": 0} for i in range(4)}))
    os.chmod(path, 0o600)
    usage = PoolUsage(ledger.devices(), 0.05, source=StandInSource(path))
    usage.sampler._latest = usage.sampler.source.read()  # this round's figures, no thread
    usage.sampler._started = True
    base = IdleRule(mode="stop", idle_seconds=100, warn_seconds=50)
    settings = IdleSettings(base, (make_rule(base, {"groups": ["lab"], "mode": "warn"}),
                                   make_rule(base, {"profiles": ["gpu-big"], "mode": "off"})), 4)
    hub = FakeHubDirectory({"ann": ((), {"default": "gpu-1"}), "bob": ((), {"big": "gpu-big"}),
                            "cy": (("lab",), {"default": "gpu-1"})})
    jobs = FakeJobs()
    culler = IdleCuller(ledger, usage, hub, settings, jobs=jobs)
    assert await culler.tick(now=1000) == []                      # idle from now
    done = await culler.tick(now=1050)                            # ann's two: warned
    assert sorted((w, h["user"], h["name"]) for w, h in done) == [
        ("warn", "ann", "default"), ("warn", "ann", "digits")]
    assert {n["name"] for n in culler.view("ann")["notices"]} == {"default", "digits"}
    done = await culler.tick(now=1100)                            # stopped; cy (lab) warned
    assert sorted((w, h["user"], h["name"]) for w, h in done) == [
        ("stop", "ann", "default"), ("stop", "ann", "digits"), ("warn", "cy", "default")]
    assert hub.stopped == [("ann", "default")]
    assert [(u, n) for u, n, _ in jobs.stopped] == [("ann", "digits")]
    assert "below 5% use for 100 s" in jobs.stopped[0][2]
    open_ids = {a.id for a in ledger.open_allocations()}
    assert open_ids == {nb_bob.id, nb_cy.id}                      # ann's GPUs are back
    assert ledger.get(nb_ann.id).end_reason.startswith("stopped: its GPUs stayed below 5%")
    assert job.id not in open_ids
    # cy's rule only warns, bob's (profile gpu-big) does nothing, for ever
    assert await culler.tick(now=5000) == []
    stops = [e["name"] for e in ledger.events("idle") if e["new"]["action"] == "stopped"]
    assert sorted(stops) == ["ann/job/digits", "ann/notebook/default"]
    usage.close()
