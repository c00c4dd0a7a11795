import pytest

from gpulab.spawner.profiles import (
    ProfileError,
    choose_profile,
    default_profile_list,
    parse_profiles,
)

H100_2 = {
    "display_name": "2 GPUs (H100)",
    "kubespawner_override": {
        "extra_resource_limits": {"nvidia.com/gpu": "2"},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
        "cpu_limit": 8,
        "mem_limit": "32G",
        "image": "ignored-locally:1",
    },
}


def test_kubespawner_shaped_profile():
    (p,) = parse_profiles([H100_2])
    assert (p.slug, p.gpus, p.model, p.cpu_limit, p.mem_limit) == (
        "2-gpus-h100", 2, "NVIDIA-H100", 8.0, "32G"
    )
    assert p.summary == "2 GPUs (NVIDIA-H100), 8 CPUs, 32G memory"


@pytest.mark.parametrize(
    "entry,message",
    [
        ({"display_name": "x", "kubespawner_override": {"nodeSelector": {}}}, "nodeSelector"),
        ({"display_name": "x", "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "-1"}}}, "whole number"),
        ({"display_name": "x", "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1.5"}}}, "whole number"),
        ({"display_name": "x", "kubespawner_override": {"cpu_limit": 0}}, "cpu_limit"),
        ({"slug": "x"}, "display_name"),
        ({"display_name": "x", "slug": "Bad Slug"}, "slug"),
    ],
    ids=["camelcase-key", "negative-gpus", "fractional-gpus", "zero-cpu", "no-name", "bad-slug"],
)
def test_bad_profiles_are_refused(entry, message):
    with pytest.raises(ProfileError, match=message):
        parse_profiles([entry])


def test_duplicate_slugs_and_defaults_refused():
    with pytest.raises(ProfileError, match="slug"):
        parse_profiles([{"display_name": "a", "slug": "s"}, {"display_name": "b", "slug": "s"}])
    with pytest.raises(ProfileError, match="default"):
        parse_profiles([{"display_name": "a", "default": True}, {"display_name": "b", "default": True}])


@pytest.mark.parametrize("total,slugs", [(0, ["cpu"]), (1, ["cpu", "gpu-1"]), (4, ["cpu", "gpu-1", "gpu-2", "gpu-4"])])
def test_default_profiles_follow_the_inventory(total, slugs):
    profiles = parse_profiles(default_profile_list(total))
    assert [p.slug for p in profiles] == slugs
    assert choose_profile(profiles, None).slug == ("gpu-1" if total else "cpu")
    with pytest.raises(LookupError):
        choose_profile(profiles, "gpu-99")


def test_local_profiles_do_not_load_the_kubernetes_client():
    """The local hub validates its profiles without importing kubespawner (its Kubernetes
    client costs the hub about 40 MiB, which bench/spawn.py saw as 1.31x stock's memory);
    a key only KubeSpawner knows still validates, by loading it then."""
    import subprocess
    import sys

    code = ("import sys\nfrom gpulab.spawner.profiles import default_profile_list, parse_profiles\n"
            "parse_profiles(default_profile_list(4))\n"
            "parse_profiles([{'display_name': 'a', 'kubespawner_override': {'cpu_limit': 2}}])\n"
            "print('kubespawner' in sys.modules)\n"
            "parse_profiles([{'display_name': 'a', 'kubespawner_override': {'image': 'x:1'}}])\n"
            "print('kubespawner' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
