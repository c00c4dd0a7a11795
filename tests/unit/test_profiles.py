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


# -- profile_options, allowed_groups, overrides (KubeSpawner's semantics) --------------------

from gpulab.spawner.profiles import (  # noqa: E402
    OptionError,
    format_value,
    merge_overrides,
    options_from_formdata,
    select,
)

ENVS = {
    "display_name": "1 GPU", "slug": "gpu-1", "default": True,
    "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"},
                             "environment": {"A": "1"}},
    "profile_options": {
        "env": {"display_name": "Environment", "choices": {
            "tf": {"display_name": "TensorFlow", "kubespawner_override": {
                "environment": {"CONDA_DEFAULT_ENV": "tf"}}},
            "torch": {"display_name": "PyTorch", "default": True, "kubespawner_override": {
                "environment": {"CONDA_DEFAULT_ENV": "torch", "A": None}}}},
            "unlisted_choice": {"enabled": True, "validation_regex": "^[a-z]+$",
                                "kubespawner_override": {
                                    "environment": {"CONDA_DEFAULT_ENV": "{value}"}}}},
        "size": {"display_name": "GPUs", "choices": {
            "one": {"display_name": "one"},
            "two": {"display_name": "two", "kubespawner_override": {
                "extra_resource_limits": {"nvidia.com/gpu": "2"}}}}},
    },
}
TEAM = {"display_name": "8 GPUs", "slug": "gpu-8", "allowed_groups": ["ml"],
        "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "8"}}}


def final(sel):
    return merge_overrides({"environment": {"B": "2"}}, sel.overrides)


@pytest.mark.parametrize("options,env,gpus", [
    ({}, {"B": "2", "CONDA_DEFAULT_ENV": "torch"}, 1),
    ({"profile": "gpu-1", "env": "tf"}, {"A": "1", "B": "2", "CONDA_DEFAULT_ENV": "tf"}, 1),
    ({"profile": "gpu-1", "env--unlisted-choice": "jax", "size": "two"},
     {"A": "1", "B": "2", "CONDA_DEFAULT_ENV": "jax"}, 2),
    ({"profile": ["gpu-1"], "env": ["tf"]}, {"A": "1", "B": "2", "CONDA_DEFAULT_ENV": "tf"}, 1),
], ids=["defaults", "choice", "unlisted-and-gpus", "passthrough-lists"])
def test_options_choose_overrides_in_kubespawners_order(options, env, gpus):
    sel = select(parse_profiles([ENVS, TEAM]), options)
    out = final(sel)
    assert out["environment"] == env
    assert out["extra_resource_limits"] == {"nvidia.com/gpu": str(gpus)}
    # the form shows each profile with its options' defaults
    assert parse_profiles([ENVS])[0].gpus == 1


@pytest.mark.parametrize("options,message", [
    ({"profile": "gpu-1", "env--unlisted-choice": "Bad Env"}, "must match ^[a-z]+$"),
    ({"profile": "gpu-1", "env": "jax"}, "has no choice 'jax'"),
    ({"profile": "gpu-1", "size--unlisted-choice": "9"}, "takes only one of: one, two"),
    ({"profile": "gpu-1", "image": "x"}, "Unknown server option(s): image"),
    ({"profile": "gpu-8"}, "There is no profile 'gpu-8'. Choose one of: gpu-1."),
    ({"profile": 3}, "'profile' must be a profile name"),
    ([], "must be a JSON object"),
], ids=["regex", "no-such-choice", "unlisted-not-enabled", "unknown-key", "other-groups",
        "not-a-name", "not-an-object"])
def test_bad_options_are_refused_in_words(options, message):
    with pytest.raises(OptionError) as e:
        select(parse_profiles([ENVS, TEAM]), options, groups=("students",))
    assert message in str(e.value)


def test_allowed_groups_hide_and_allow():
    profiles = parse_profiles([ENVS, TEAM])
    assert select(profiles, {"profile": "gpu-8"}, groups=("ml",)).profile.slug == "gpu-8"
    # only team profiles, none default: the first the person may use is the default
    only_team = parse_profiles([TEAM, {**TEAM, "slug": "gpu-4", "allowed_groups": ["x"]}])
    assert select(only_team, {}, groups=("x",)).profile.slug == "gpu-4"
    with pytest.raises(OptionError, match="No profile is available to you"):
        select(only_team, {}, groups=())


def test_keys_of_an_operators_own_form_are_left_to_them():
    sel = select(parse_profiles([ENVS]), {"profile": "gpu-1", "flavour": ["x"], "_xsrf": ["t"]},
                 strict=False)
    assert sel.profile.slug == "gpu-1" and sel.choices == {"env": "torch", "size": "one"}


def test_form_fields_read_as_kubespawner_reads_them():
    form = {"profile": ["gpu-1"], "_xsrf": ["t"], "profile-option-gpu-1--env": ["tf"],
            "profile-option-gpu-1--env--unlisted-choice": ["jax"],
            "profile-option-gpu-8--x": ["y"], "gpus": ["3"]}
    assert options_from_formdata(form) == (
        {"profile": "gpu-1", "env": "tf", "env--unlisted-choice": "jax"}, ["gpus"])


def test_unlisted_values_fill_only_value_fields():
    assert format_value({"image": "{value}", "x": ["a-{value}", "{other}"], "n": 1},
                        "pangeo/x:{y}") == {"image": "pangeo/x:{y}",
                                             "x": ["a-pangeo/x:{y}", "{other}"], "n": 1}


@pytest.mark.parametrize("entry,message", [
    ({"display_name": "x", "profile_options": {"o": {"choices": {}}}}, "needs 'choices'"),
    ({"display_name": "x", "profile_options": {"o": {"choices": {"a": {
        "kubespawner_override": {"nodeSelector": {}}}}}}}, "nodeSelector"),
    ({"display_name": "x", "profile_options": {"o": {"unlisted_choice": {
        "enabled": True, "validation_regex": "("}}}}, "validation_regex"),
    ({"display_name": "x", "allowed_groups": "ml"}, "allowed_groups"),
], ids=["empty-option", "camelcase-in-choice", "bad-regex", "groups-not-a-list"])
def test_bad_profile_options_are_configuration_errors(entry, message):
    with pytest.raises(ProfileError, match=message):
        parse_profiles([entry])
