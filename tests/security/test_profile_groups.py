"""Profiles per group and the closing of a server's leftover GPUs, attacked as another account
(issue 15): eve, not in group ``ml``, tries to start vic's team profile through the API, a
tampered form, a pass-through list, and her own hub token from her terminal; and she starts
servers named like vic's (and a named server "default" beside her own default one), hoping
that closing "leftovers" of the same server name closes someone's GPUs. Each fails and the
servers keep their GPUs."""

import pytest

from tests.conftest import hub_with_config

CONFIG = '''
c.LocalGPUSpawner.profile_list = [
    {"display_name": "CPU only", "slug": "cpu", "default": True},
    {"display_name": "1 GPU", "slug": "gpu-1",
     "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"}}},
    {"display_name": "3 GPUs (ml)", "slug": "team", "allowed_groups": ["ml"],
     "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "3"}}},
]
'''


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    yield from hub_with_config(workdir, prefix, CONFIG)


@pytest.fixture(scope="module")
def team(hub, admin, vic, eve):
    assert admin.api("POST", "/groups/ml", json={"users": ["vic"]}).status_code == 201
    vic.stop_server("")
    r = vic.start_server("", {"profile": "team"})
    assert r.status_code in (201, 202), r.text
    return admin


def holdings(person):
    """The person's open allocations: id, kind, server, GPUs, devices."""
    return [(h["id"], h["kind"], h["name"], h["gpus"], tuple(h["devices"]))
            for h in person.service("GET", "me").json()["holdings"]]


def test_eve_cannot_start_or_see_the_groups_profile(hub, team, vic, eve):
    assert 'value="team"' not in eve.s.get(hub.url + "/hub/spawn/eve/x").text
    eve.stop_server("")
    for options in ({"profile": "team"}, {"profile": ["team"]}, {"profile": "TEAM"},
                    {"profile": "team", "allowed_groups": ["ml"]}):
        r = eve.start_server("", options)
        assert r.status_code == 400, (options, r.text)
        assert "There is no profile" in r.json()["message"] or "Unknown" in r.json()["message"]
    r = eve.post_form("/hub/spawn/eve", {"profile": "team"})
    assert r.status_code == 400 and "There is no profile" in r.text
    # with her own token from her own terminal
    out = eve.sh('curl -s -o /dev/null -w "%{http_code}" -X POST '
                 '-H "Authorization: token $JUPYTERHUB_API_TOKEN" '
                 '-d \'{"profile": "team"}\' "$HUB/hub/api/users/eve/servers/t"')
    assert out.stdout.strip() == "400", out.stdout + out.stderr
    assert eve.api("GET", "/users/eve").json()["servers"] == {}
    # vic's team server runs on its 3 GPUs all along
    assert vic.api("GET", "/users/vic").json()["servers"][""]["ready"]


def test_eves_servers_named_like_vics_leave_vics_gpus_alone(hub, team, vic, eve):
    before = holdings(vic)
    assert [h[1:4] for h in before] == [("notebook", "default", 3)]
    r = eve.start_server("", {"profile": "gpu-1"})
    assert r.status_code in (201, 202), r.text
    mine = holdings(eve)
    assert [h[1:4] for h in mine] == [("notebook", "default", 1)]
    # a named server called "default" would be taken for her default server by the ledger
    # (and its start would close that server's allocation while it runs: more GPUs than her
    # quota, its GPU handed to the next person): refused, and nothing of hers or vic's moves
    r = eve.start_server("default", {"profile": "gpu-1"})
    assert r.status_code == 400 and "cannot be called 'default'" in r.text, r.text
    assert holdings(eve) == mine
    eve.stop_server("")
    assert holdings(vic) == before
    assert vic.api("GET", "/users/vic").json()["servers"][""]["ready"]
