"""The hot paths stay free of per-person work (issue 40): a queue pass, the admin page's
overview and the reconciler read the ledger the same number of times for 10 people as for
100 (SQL statements counted with a SQLAlchemy event listener on a real SQLite ledger), so a
loop that asks the database once per person fails here before it shows at 2,000 people."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import pytest
from sqlalchemy import event

from gpulab.hub.quota.ledger import DeviceInfo, Ledger, Request
from gpulab.hub.quota.policy import Quota
from gpulab.hub.quota.waiting import Queue
from gpulab.hub.service.quotas import _overview, known_names
from gpulab.hub.service.reconciler import close_orphaned_notebooks

T = 1_000_000.0
H = 3600.0


@contextmanager
def counted(ledger: Ledger):
    """The SQL statements run on `ledger`'s engine inside the block (``n[0]``)."""
    n = [0]

    def count(*args):
        n[0] += 1

    event.listen(ledger.engine, "before_cursor_execute", count)
    try:
        yield n
    finally:
        event.remove(ledger.engine, "before_cursor_execute", count)


def crowd(tmp_path, people: int) -> Ledger:
    """A ledger with one GPU per person, each holding it with a notebook and waiting for
    one more with a job; group quotas with GPU-hour windows short and long (past the
    queue's own history read), and a few personal overrides."""
    lg = Ledger(f"sqlite:///{tmp_path}/ledger-{people}.sqlite")
    lg.migrate()
    lg.sync_inventory([DeviceInfo(i, model="H100") for i in range(people)])
    lg.set_quota("default", "", Quota(4), actor="admin")
    lg.set_quota("group", "short", Quota(4, None, 500.0, 24), actor="admin")
    lg.set_quota("group", "long", Quota(4, None, 5000.0, 24 * 365), actor="admin")
    for i in range(0, people, 7):
        lg.set_quota("user", f"p{i:03d}", Quota(3), actor="admin")
    q = Queue(lg)
    for i in range(people):
        groups = (("short",), ("long",), ())[i % 3]
        lg.admit(Request(f"p{i:03d}", "notebook", "nb", 1, groups=groups), now=T - 2 * H)
        q.enqueue(Request(f"p{i:03d}", "job", "train", 1, groups=groups), now=T - H)
    return lg


@pytest.fixture(scope="module")
def crowds(tmp_path_factory):
    base = tmp_path_factory.mktemp("crowds")
    return {n: crowd(base, n) for n in (10, 100)}


def test_a_queue_pass_reads_as_often_for_100_people_as_for_10(crowds):
    counts = {}
    for n, lg in crowds.items():
        q = Queue(lg)
        with counted(lg) as c:
            p = q.schedule(now=T)
        assert p.started == []  # every GPU is held: everyone waits
        with counted(lg) as e:
            entries = q.entries(now=T)
        assert len(entries) == n
        counts[n] = (c[0], e[0])
    assert counts[10] == counts[100], counts


def test_the_queue_pass_still_counts_gpu_hours_in_long_windows(crowds):
    """The batched reads give the figures the per-person ones gave: a person in the group
    with a year's window whose use is past the pass's own history is refused by it."""
    lg = crowds[10]
    q = Queue(lg)
    # p001 ("long": 5,000 GPU-hours a year) used 4,999 GPU-hours 100 days ago (on the GPU
    # its notebook holds now), and 2 more since with its notebook
    nb = lg.open_allocations(user="p001")[0]
    lg.release(nb.id, now=T - 3 * H)
    old = lg.admit(Request("p001", "job", "old", 1, groups=("long",)),
                   now=T - 100 * 24 * H - 4999 * H)
    lg.release(old.id, now=T - 100 * 24 * H)
    lg.admit(Request("p001", "notebook", "nb", 1, groups=("long",)), now=T - 2 * H)
    why = {e.user: e.reason for e in q.entries(now=T)}
    assert "GPU-hour" in why["p001"], why["p001"]
    assert "GPU-hour" not in why["p004"], why["p004"]  # the same group, no history


def users(n: int) -> list[dict]:
    return [{"name": f"p{i:03d}", "groups": [("short", "long", "none")[i % 3]], "admin": False}
            for i in range(n)]


def test_the_admin_overview_reads_as_often_for_100_people_as_for_10(crowds):
    counts = {}
    for n, lg in crowds.items():
        with counted(lg) as c:
            o = _overview(lg, users(n), None, T, "", 0, 5)
        counts[n] = c[0]
        assert [u["name"] for u in o["users"]] == [f"p{i:03d}" for i in range(5)]
        assert o["users_total"] == n and o["users"][0]["quota_source"] == "user"
        assert o["users"][1]["quota_source"] == "group 'long'"
        assert o["users"][1]["gpus_held"] == 1
        assert {g["name"]: len(g["members"]) for g in o["groups"]}["none"] == n // 3
    assert counts[10] == counts[100], counts


def test_the_admin_overview_pages_and_searches(crowds):
    lg = crowds[100]
    everyone = users(100) + [{"name": "Zed", "groups": ["physics"], "admin": False}]
    pages, offset = [], 0
    while True:
        o = _overview(lg, everyone, None, T, "", offset, 30)
        pages.append([u["name"] for u in o["users"]])
        offset += 30
        if offset >= o["users_total"]:
            break
    assert [len(p) for p in pages] == [30, 30, 30, 11]
    assert sum(pages, []) == sorted(u["name"] for u in everyone)
    # by part of a name or a group, any case; the total is of the matches
    o = _overview(lg, everyone, None, T, "zE", 0, 30)
    assert [u["name"] for u in o["users"]] == ["Zed"] and o["users_total"] == 1
    o = _overview(lg, everyone, None, T, "PHYS", 0, 30)
    assert [u["name"] for u in o["users"]] == ["Zed"] and o["everyone"] == 101
    assert _overview(lg, everyone, None, T, "p09", 0, 30)["users_total"] == 10
    # people the hub no longer lists with an override still appear (and are found)
    lg.set_quota("user", "left-the-lab", Quota(1), actor="admin")
    assert [u["name"] for u in known_names(lg, everyone, "left")] == ["left-the-lab"]


class Directory:
    """The hub's servers as the reconciler reads them (every person's notebook 'nb')."""

    def __init__(self, names):
        self.active = {(n, "nb") for n in names}

    async def active_servers(self):
        return set(self.active)


def test_a_reconciler_pass_reads_as_often_for_100_servers_as_for_10(crowds):
    counts = {}
    for n, lg in crowds.items():
        d = Directory(f"p{i:03d}" for i in range(n))
        with counted(lg) as c:
            closed = asyncio.run(close_orphaned_notebooks(lg, d, grace=30))
        assert closed == []
        counts[n] = c[0]
    assert counts[10] == counts[100], counts
    # a server the hub lost is closed, and only that one
    lg = crowds[10]
    d = Directory(f"p{i:03d}" for i in range(1, 10))
    closed = asyncio.run(close_orphaned_notebooks(lg, d, grace=0))
    assert [(a.user, a.holder) for a in closed] == [("p000", "nb")]


def test_a_servers_internal_tls_key_is_ecdsa_signed_by_the_rsa_ca_and_serves_tls(tmp_path):
    """The storm's profile (bench/scale.py --profile) had half the hub's samples in RSA key
    generation; servers' keys are ECDSA P-256 now (`server_key_pair`), still signed by the
    hub's notebooks CA: a real TLS handshake with the CA as the only trust."""
    import socket
    import ssl
    import threading

    from certipy import Certipy
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

    from gpulab.spawner.local import server_key_pair

    hub = Certipy(store_dir=str(tmp_path / "store"))
    ca = hub.create_ca("notebooks-ca")
    own = Certipy(store_dir=str(tmp_path / "server"))
    own.create_key_pair = server_key_pair
    own.store.store["notebooks-ca"] = hub.store.get_record("notebooks-ca")
    pair = own.create_signed_pair("user-ann", "notebooks-ca", alt_names=["IP:127.0.0.1"])
    cert = x509.load_pem_x509_certificate(open(pair["files"]["cert"], "rb").read())
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(pair["files"]["cert"], pair["files"]["key"])
    client = ssl.create_default_context(cafile=ca["files"]["cert"])
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve():
            conn, _ = listener.accept()
            with server.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"up")

        t = threading.Thread(target=serve)
        t.start()
        with client.wrap_socket(socket.create_connection(("127.0.0.1", port)),
                                server_hostname="127.0.0.1") as tls:
            assert tls.recv(2) == b"up"
        t.join(10)


def test_usage_windows_sum_in_the_database_as_usage_sums_in_python(tmp_path):
    """The admin page's 7- and 30-day GPU-hours come from one aggregate query
    (`Ledger.usage_windows`); they equal `Ledger.usage`'s for each window: allocations
    across either edge, open ones, and ones of no GPUs."""
    lg = Ledger(f"sqlite:///{tmp_path}/l.sqlite")
    lg.migrate()
    lg.sync_inventory([DeviceInfo(i) for i in range(4)])
    now = T + 40 * 24 * H
    spans = [("ann", 2, T, T + 20 * 24 * H), ("ann", 1, now - 8 * 24 * H, now - 6 * 24 * H),
             ("bob", 1, now - 3 * H, None), ("cy", 0, now - 5 * H, None),
             ("dee", 1, now - 31 * 24 * H, now - 29 * 24 * H)]
    for i, (user, gpus, start, end) in enumerate(spans):
        a = lg.admit(Request(user, "job", f"j{i}", gpus), now=start)
        if end is not None:
            lg.release(a.id, now=end)
    week, month = lg.usage_windows((now - 7 * 24 * H, now - 30 * 24 * H), now)
    for got, since in ((week, now - 7 * 24 * H), (month, now - 30 * 24 * H)):
        want = lg.usage(since, now)
        assert set(got) == {u for u, v in want.items() if v}
        for user in want:
            assert abs(got[user] - want[user]) < 1e-6, (user, got[user], want[user])
    assert week["ann"] == 24 and month["dee"] == 24 and "cy" not in month


def test_the_queue_sums_the_history_in_the_database_as_the_policy_sums_it(tmp_path):
    """A plan's decayed use and budget windows are summed by the database (`Queue._read`:
    at 100,000 past allocations, carrying the history into Python was 60 % of the service's
    samples, bench/scale.py --only-pages --profile); they equal `policy.decayed_usage` and
    `Ledger.usage` on the same history: spans across the five-half-life edge and a window's
    edge, open ones, ones of no GPUs, people not asked for left out."""
    from gpulab.hub.quota import queue as policy

    lg = Ledger(f"sqlite:///{tmp_path}/l.sqlite")
    lg.migrate()
    lg.sync_inventory([DeviceInfo(i) for i in range(4)])
    q = Queue(lg, half_life_hours=24)
    now = T + 40 * 24 * H
    spans = [("ann", 2, T, T + 20 * 24 * H), ("ann", 1, now - 8 * 24 * H, now - 6 * 24 * H),
             ("ann", 1, now - 6 * 24 * H, now - 4 * 24 * H),  # across the 5-day edge
             ("bob", 1, now - 3 * H, None), ("cy", 0, now - 5 * H, None),
             ("dee", 1, now - 31 * 24 * H, now - 29 * 24 * H), ("eve", 3, now - H, now)]
    for i, (user, gpus, start, end) in enumerate(spans):
        a = lg.admit(Request(user, "job", f"j{i}", gpus), now=start)
        if end is not None:
            lg.release(a.id, now=end)
    asked = {"ann", "bob", "cy", "dee"}
    with lg.Reader() as s:
        decayed = q._decayed_usage(s, asked, now)
        windows = {"ann": now - 7 * 24 * H, "bob": now - H, "dee": now - 30 * 24 * H}
        used = q._window_usage(s, windows, now)
    recent = [(u, g, a, b) for u, g, a, b in spans if b is None or b > now - 5 * 24 * H]
    want = policy.decayed_usage(recent, now, 24 * H)
    assert set(decayed) == {"ann", "bob"}  # dee's use ended before the edge; cy has no GPUs
    for user in decayed:
        assert abs(decayed[user] - want[user]) < 1e-9, (user, decayed[user], want[user])
    for user, since in windows.items():
        assert abs(used[user] - lg.usage(since, now).get(user, 0.0)) < 1e-6, user
    assert used == pytest.approx({"ann": 72.0, "bob": 1.0, "dee": 24.0})
