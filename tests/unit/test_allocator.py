import pytest

from gpulab.spawner.allocator import ClaimConflict, GPUAllocator, Holder, InsufficientGPUs
from gpulab.spawner.inventory import simulated_gpus


def holder(user, name=""):
    return Holder("notebook", user, name)


def test_claims_are_disjoint_and_released():
    a = GPUAllocator(simulated_gpus(4))
    c1 = a.claim(holder("ann", "big"), 2)
    c2 = a.claim(holder("bob"), 1)
    assert {g.index for g in c1.gpus}.isdisjoint({g.index for g in c2.gpus})
    assert len(a.free_gpus()) == 1
    a.release(c1.id)
    assert len(a.free_gpus()) == 3
    assert a.release(c1.id) is None  # a second release frees nothing else


def test_refusal_names_own_servers_but_not_other_users():
    a = GPUAllocator(simulated_gpus(4))
    a.claim(holder("ann", "big"), 2)
    a.claim(holder("bob", "secret-project"), 1)
    with pytest.raises(InsufficientGPUs) as e:
        a.claim(holder("ann", "more"), 2)
    msg = e.value.message
    assert "1 of 4 is free" in msg
    assert "your server 'big' (2)" in msg
    assert "1 held by other users" in msg
    assert "bob" not in msg and "secret-project" not in msg
    assert len(a.free_gpus()) == 1  # the refused request took nothing


@pytest.mark.parametrize(
    "count,model,expected",
    [
        (5, None, "has only 4"),
        (1, "NVIDIA-A100", "no GPU of model NVIDIA-A100"),
    ],
    ids=["more-than-machine", "unknown-model"],
)
def test_impossible_requests(count, model, expected):
    a = GPUAllocator(simulated_gpus(4))
    with pytest.raises(InsufficientGPUs) as e:
        a.claim(holder("ann"), count, model)
    assert expected in e.value.message


def test_model_selector_matches_prefix():
    a = GPUAllocator(simulated_gpus(2, model="NVIDIA H100 80GB HBM3"))
    c = a.claim(holder("ann"), 2, "NVIDIA-H100")
    assert [g.model for g in c.gpus] == ["NVIDIA-H100-80GB-HBM3"] * 2


def test_dead_holders_are_reaped_when_gpus_run_out():
    a = GPUAllocator(simulated_gpus(2))
    alive = {"v": True}
    c = a.claim(holder("ann"), 2)
    a.set_probe(c.id, lambda: alive["v"])
    with pytest.raises(InsufficientGPUs):
        a.claim(holder("bob"), 1)
    alive["v"] = False
    assert len(a.claim(holder("bob"), 1).gpus) == 1
    assert a.get(c.id) is None


def test_restore_never_assigns_a_gpu_twice():
    a = GPUAllocator(simulated_gpus(4))
    a.restore("c1", holder("ann"), [0, 1])
    assert a.restore("c1", holder("ann"), [0, 1]).id == "c1"  # idempotent
    with pytest.raises(ClaimConflict):
        a.restore("c2", holder("bob"), [1, 2])
    with pytest.raises(ClaimConflict):
        a.restore("c3", holder("bob"), [7])
    assert a.held_indices() == {0, 1}
    assert [g.index for g in a.claim(holder("bob"), 2).gpus] == [2, 3]
