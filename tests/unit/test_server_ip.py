"""`gpulab.spawner.local.server_ip`: one loopback address per server, never two the same,
never one of the hub's own (127.0.0.x) nor a host part .0 or .255."""

import ipaddress

import pytest

from gpulab.spawner.local import server_ip


def test_addresses_are_distinct_loopback_and_avoid_the_hubs():
    seen = set()
    for i in range(1, 100_000):
        ip = server_ip(i)
        addr = ipaddress.ip_address(ip)
        assert addr in ipaddress.ip_network("127.0.0.0/8"), ip
        assert addr not in ipaddress.ip_network("127.0.0.0/24"), ip
        assert ip.rsplit(".", 1)[1] not in ("0", "255"), ip
        seen.add(ip)
    assert len(seen) == 100_000 - 1


@pytest.mark.parametrize("spawner_id,ip", [
    (1, "127.1.0.1"), (254, "127.1.0.254"), (255, "127.1.1.1"), (254 * 256, "127.1.255.254"),
    (254 * 256 + 1, "127.2.0.1"), (254 * 256 * 255, "127.255.255.254"),
])
def test_the_sequence(spawner_id, ip):
    assert server_ip(spawner_id) == ip


@pytest.mark.parametrize("bad", [0, -1, 254 * 256 * 255 + 1])
def test_out_of_range_ids_are_refused(bad):
    with pytest.raises(ValueError):
        server_ip(bad)
