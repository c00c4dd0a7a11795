"""Quota policy as tables: which quota applies, and what it refuses."""

import pytest

from gpulab.hub.quota.policy import (MAX_DISK, MIN_DISK, Holding, Quota, QuotaError, disk_input,
                                     effective_disk, effective_quota, parse_disk,
                                     parse_quota, refusal)

D = Quota(1)
SMALL = Quota(2, max_per_request=1)
BIG = Quota(8)
BUDGET = Quota(8, gpu_hours=10, window_hours=168)


@pytest.mark.parametrize(
    "default,groups,user,expected,source",
    [
        (None, {}, None, None, "none"),
        (D, {}, None, D, "default"),
        (D, {"students": SMALL}, None, SMALL, "group 'students'"),
        (D, {"students": SMALL, "staff": BIG}, None, BIG, "group 'staff'"),
        # an override wins even when it is smaller than a group's quota
        (D, {"staff": BIG}, Quota(0), Quota(0), "user"),
        # equal GPUs: the group without a GPU-hour budget is the more generous one
        (D, {"a": BUDGET, "b": BIG}, None, BIG, "group 'b'"),
    ],
    ids=["nothing-set", "default", "one-group", "most-generous-group", "override-wins",
         "budget-less-generous"],
)
def test_effective_quota(default, groups, user, expected, source):
    assert effective_quota(default, groups, user) == (expected, source)


NB = Holding("notebook", "default", 1)
JOB = Holding("job", "digits-3", 1)


@pytest.mark.parametrize(
    "quota,requested,holdings,used,expect",
    [
        (None, 64, [], 0, None),
        (Quota(2), 2, [], 0, None),
        (Quota(2), 1, [NB], 0, None),
        (Quota(2), 1, [NB, JOB], 0,
         "2 of your 2 GPUs are in use: notebook 'default' (1), job 'digits-3' (1)"),
        (Quota(2), 3, [], 0, "your quota is 2 GPUs at once"),
        (Quota(4, max_per_request=2), 3, [], 0, "allows at most 2 in one request"),
        (BUDGET, 1, [], 9.5, None),
        (BUDGET, 1, [], 10.0, "10 of your 10 GPU-hours over the last 7 days"),
        (Quota(0), 0, [], 0, None),  # CPU-only servers are never refused
    ],
    ids=["no-quota", "fits", "fits-with-holding", "full", "too-big", "per-request",
         "under-budget", "budget-spent", "zero-gpus"],
)
def test_refusal(quota, requested, holdings, used, expect):
    why = refusal(quota, "user", requested, holdings, used)
    if expect is None:
        assert why is None
    else:
        assert why is not None and expect in why


def test_refusal_names_the_group_it_comes_from():
    why = refusal(Quota(1), "group 'students'", 2, [], 0)
    assert "(from group 'students')" in why


@pytest.mark.parametrize(
    "body,field",
    [
        ({"max_gpus": -1}, "max_gpus"),
        ({"max_gpus": 1.5}, "max_gpus"),
        ({"max_gpus": 10**9}, "max_gpus"),
        ({"max_gpus": True}, "max_gpus"),
        ({}, "max_gpus"),
        ({"max_gpus": 1, "colour": "red"}, "colour"),
        ({"max_gpus": 1, "max_per_request": 0}, "max_per_request"),
        ({"max_gpus": 1, "gpu_hours": 5}, "window_hours"),
        ({"max_gpus": 1, "gpu_hours": 5, "window_hours": 0}, "window_hours"),
        ({"max_gpus": 1, "gpu_hours": float("nan"), "window_hours": 24}, "gpu_hours"),
        ({"max_gpus": 1, "window_hours": 24}, "gpu_hours"),
        ([1, 2], "body"),
    ],
    ids=["negative", "fractional", "absurd", "bool", "missing", "unknown-field",
         "per-request-zero", "budget-without-window", "window-zero", "nan-hours",
         "window-without-budget", "not-an-object"],
)
def test_bad_quotas_name_the_field(body, field):
    with pytest.raises(QuotaError) as e:
        parse_quota(body)
    assert e.value.field == field and field in e.value.message


def test_good_quota_round_trips():
    q = parse_quota({"max_gpus": 4, "max_per_request": 2, "gpu_hours": 100, "window_hours": 168})
    assert q == Quota(4, 2, 100.0, 168)
    assert q.describe() == "4 GPUs at once, at most 2 per request, 100 GPU-hours per 7 days"


# -- the disk limit on the shared storage -------------------------------------------------

GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize("value,size", [
    (None, None), ("20G", 20 * GiB), ("20GiB", 20 * GiB), ("20gb", 20 * GiB),
    ("512M", 512 * MiB), ("1.5T", 3 * 2**39), (" 64 MiB ", 64 * MiB), (2**30, GiB),
    ("1P", MAX_DISK), (MIN_DISK, MIN_DISK),
], ids=["none", "G", "GiB", "gb", "M", "fraction", "spaces", "bytes", "largest", "smallest"])
def test_disk_sizes_read_binary_units(value, size):
    assert parse_disk(value) == size
    if size is not None:  # the admin page's input reads back exactly what is stored
        assert parse_disk(disk_input(size)) == size


@pytest.mark.parametrize("value", [
    "lots", "-1G", "20 X", "1e3G", "", "G", True, 1.5, [20], {"G": 1}, "31M", MIN_DISK - 1,
    "2P", MAX_DISK + 1, "20G20G",
], ids=["word", "negative", "unit", "exponent", "empty", "no-number", "bool", "float", "list",
        "object", "too-small", "bytes-too-small", "too-large", "bytes-too-large", "twice"])
def test_bad_disk_limits_are_refused_naming_the_field(value):
    with pytest.raises(QuotaError) as e:
        parse_quota({"max_gpus": 1, "disk": value})
    assert e.value.field == "disk" and "'disk' must be" in e.value.message
    assert repr(value) in e.value.message  # says what it got


def test_a_disk_limit_round_trips_and_is_described():
    q = parse_quota({"max_gpus": 1, "disk": "20G"})
    assert q == Quota(1, disk=20 * GiB) and q.as_dict()["disk"] == 20 * GiB
    assert q.describe() == "1 GPU at once, 20 GiB disk"


@pytest.mark.parametrize("default,groups,user,expected", [
    (None, {}, None, (None, "none")),
    (Quota(1), {"a": Quota(8)}, Quota(2), (None, "none")),
    (Quota(1, disk=GiB), {}, None, (GiB, "default")),
    # the disk is decided on its own: the largest group disk, not the most generous GPUs'
    (Quota(1, disk=GiB), {"a": Quota(8), "b": Quota(1, disk=5 * GiB),
                          "c": Quota(1, disk=2 * GiB)}, None, (5 * GiB, "group 'b'")),
    # the person's own wins, smaller or not; their own without a disk leaves it to the rest
    (Quota(1, disk=GiB), {"b": Quota(1, disk=5 * GiB)}, Quota(1, disk=MIN_DISK),
     (MIN_DISK, "user")),
    (Quota(1, disk=GiB), {"b": Quota(1, disk=5 * GiB)}, Quota(4), (5 * GiB, "group 'b'")),
], ids=["nothing", "no-disk-anywhere", "default", "largest-group", "own-wins",
        "own-without-disk"])
def test_effective_disk(default, groups, user, expected):
    assert effective_disk(default, groups, user) == expected


@pytest.mark.parametrize("quota,gpus,words", [
    (Quota(2), 3, "Quota exceeded: this request asks for 3 GPUs; your quota (the default quota) "
                  "is 2 GPUs at once. Ask for fewer or ask an admin for a larger quota."),
    (Quota(8, max_per_request=2), 3,
     "Quota exceeded: this request asks for 3 GPUs; your quota (the default quota) allows at "
     "most 2 in one request. Ask for fewer, or ask an admin."),
], ids=["at-once", "per-request"])
def test_a_request_that_can_never_fit_is_refused_in_one_wording(quota, gpus, words):
    """"Can never fit the quota" is one rule (`never_fits`) in one wording: the ledger's
    admission (`refusal`) and the queue's (`refusal_now`) say the same, holdings or not;
    the spawn form says it short."""
    from gpulab.hub.quota.policy import never_fits
    from gpulab.hub.quota.queue import Device, refusal_now

    assert never_fits(quota, gpus).message("default") == words
    assert refusal(quota, "default", gpus, []) == words
    assert refusal(quota, "default", gpus, [NB]) == words  # stopping the notebook won't help
    assert refusal_now(gpus, None, quota, [Device(i, "H100") for i in range(8)],
                       source="default") == words
    assert never_fits(quota, gpus).short().startswith("more than your quota allows (")
    assert never_fits(quota, gpus - 1) is None and never_fits(None, 64) is None
