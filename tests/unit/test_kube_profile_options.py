"""KubeGPUSpawner configured exactly like a stock KubeSpawner with ``profile_options``: the same
``user_options`` from the same form, the same overrides on the same pod (image, limits,
environment, …), from the form and from the API, plus gpulab's GPU parts. Both spawners are
KubeSpawner's mock instances (``_mock=True``, no API server: `get_pod_manifest` is pure); the
ledger is a real SQLite one. The pods themselves are created on a real API server in
tests/cluster/test_kube_spawner.py."""

import copy

import pytest
from kubernetes_asyncio.client import ApiClient
from kubespawner import KubeSpawner
from kubespawner.clients import load_config
from traitlets.config import Config

from gpulab.spawner.kube import KubeGPUSpawner
from gpulab.hub.quota.settings import GPULedger
from gpulab.spawner.mixin import SpawnRefused

#: upstream KubeSpawner's own test profiles (tests/test_spawner.py), with GPUs in some choices
PROFILES = [
    {"display_name": "Training Env - Python", "slug": "training-python", "default": True,
     "kubespawner_override": {"image": "training/python:label", "cpu_limit": 1,
                              "mem_limit": 512 * 1024 * 1024,
                              "environment": {"override": "override-value"}}},
    {"display_name": "Training Env - R", "slug": "training-r",
     "kubespawner_override": {"image": "training/r:label",
                              "environment": {"override": "override-value",
                                              "to-remove": None}}},
    {"display_name": "Test choices", "slug": "test-choices",
     "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"}},
     "profile_options": {
         "image": {
             "display_name": "Image",
             "unlisted_choice": {"enabled": True, "display_name": "Image Location",
                                 "validation_regex": "^pangeo/.*$",
                                 "validation_message": "Must be a pangeo image",
                                 "kubespawner_override": {
                                     "image": "{value}",
                                     "extra_labels": {"user-image": "{value}"}}},
             "choices": {
                 "pytorch": {"display_name": "PyTorch",
                             "kubespawner_override": {"image": "pangeo/pytorch-notebook:master"}},
                 "tf": {"display_name": "TF", "default": True,
                        "kubespawner_override": {"image": "training/r:label"}},
             }},
         "gpus": {
             "display_name": "GPUs",
             "choices": {
                 "one": {"display_name": "1 GPU"},
                 "two": {"display_name": "2 GPUs (H100)", "kubespawner_override": {
                     "extra_resource_limits": {"nvidia.com/gpu": "2"},
                     "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
                     "environment": {"BIG": lambda spawner: f"for {spawner.user.name}"}}},
             }},
     }},
    {"display_name": "Test choices no regex", "slug": "no-regex",
     "profile_options": {"image": {
         "display_name": "Image",
         "unlisted_choice": {"enabled": True, "display_name": "Image Location",
                             "kubespawner_override": {"image": "{value}"}},
         "choices": {"tf": {"display_name": "TF",
                            "kubespawner_override": {"image": "training/r:label"}}}}}},
]

CASES = [
    # (id, form data, the same options sent to the API, GPUs)
    ("default-profile", {}, {}, 0),
    ("profile", {"profile": ["training-r"]}, {"profile": "training-r"}, 0),
    ("default-choices", {"profile": ["test-choices"]}, {"profile": "test-choices"}, 1),
    ("choices", {"profile": ["test-choices"], "profile-option-test-choices--image": ["pytorch"],
                 "profile-option-test-choices--gpus": ["two"]},
     {"profile": "test-choices", "image": "pytorch", "gpus": "two"}, 2),
    ("unlisted-with-regex",
     {"profile": ["test-choices"],
      "profile-option-test-choices--image--unlisted-choice": ["pangeo/test:1.2.3"]},
     {"profile": "test-choices", "image--unlisted-choice": "pangeo/test:1.2.3"}, 1),
    ("unlisted-without-regex",
     {"profile": ["no-regex"], "profile-option-no-regex--image--unlisted-choice": ["any/img:1"]},
     {"profile": "no-regex", "image--unlisted-choice": "any/img:1"}, 0),
]


@pytest.fixture
def config(tmp_path, monkeypatch):
    offline_kubeconfig(tmp_path, monkeypatch)
    c = Config()
    c.KubeSpawner.profile_list = PROFILES
    c.KubeSpawner.environment = {"existing": "existing-value", "to-remove": "x"}
    c.KubeGPUSpawner.storage_pvc_ensure = False
    c.GPULedger.db_url = f"sqlite:///{tmp_path / 'gpulab.sqlite'}"
    c.GPULedger.pool = "kubernetes"
    GPULedger.clear_instance()
    yield c
    GPULedger.clear_instance()
    load_config.cache_clear()


def pod_dict(pod) -> dict:
    return ApiClient().sanitize_for_serialization(pod)


async def manifests(config, options_of):
    """The pods of a stock KubeSpawner and of KubeGPUSpawner, each given its user_options by
    `options_of(spawner)`."""
    stock = KubeSpawner(config=copy.deepcopy(config), _mock=True)
    gpu = KubeGPUSpawner(config=copy.deepcopy(config), _mock=True)
    out = []
    for s in (stock, gpu):
        s.user_options = options_of(s)
        await s.load_user_options()
        out.append(pod_dict(await s.get_pod_manifest()))
    return stock, gpu, out


def strip_gpulab(pod: dict, gpus: int) -> dict:
    """`pod` less what gpulab adds to every pod (GPU toleration, shared volumes, no
    service-account token), which the test checks apart."""
    pod = copy.deepcopy(pod)
    spec = pod["spec"]
    tolerations = spec.pop("tolerations", [])
    assert ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            in tolerations) == bool(gpus)
    assert spec.pop("automountServiceAccountToken") is False
    # the container runtime's seccomp filter (issue 33), where the operator chose none
    context = spec.pop("securityContext")
    assert context.pop("seccompProfile") == {"type": "RuntimeDefault"}
    if context:
        spec["securityContext"] = context
    return pod


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("via", ["form", "api"])
async def test_the_same_pod_as_kubespawner_plus_gpus(config, case, via):
    _, form, api, gpus = case
    if via == "form":
        stock, gpu, (want, got) = await manifests(
            config, lambda s: s.options_from_form({**form, "_xsrf": ["x"]}))
        assert gpu.user_options == stock.user_options
    else:
        stock, gpu, (want, got) = await manifests(config, lambda s: dict(api))
    assert gpu.gpu_profile.gpus == gpus
    c_want, c_got = want["spec"]["containers"][0], got["spec"]["containers"][0]
    assert c_got["image"] == c_want["image"]
    assert c_got["resources"] == c_want["resources"]
    if gpus:
        assert c_got["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    env_want = {e["name"]: e.get("value") for e in c_want["env"]}
    env_got = {e["name"]: e.get("value") for e in c_got["env"]}
    assert {k: env_got.get(k) for k in env_want} == env_want
    assert want["metadata"]["labels"].items() <= got["metadata"]["labels"].items()
    assert got["spec"].get("nodeSelector") == want["spec"].get("nodeSelector")
    strip_gpulab(got, gpus)
    await gpu.release_gpus_async()


async def test_a_second_start_undoes_the_first_starts_choices(config):
    gpu = KubeGPUSpawner(config=copy.deepcopy(config), _mock=True)
    gpu.user_options = {"profile": "test-choices", "gpus": "two",
                        "image--unlisted-choice": "pangeo/x:1"}
    await gpu.load_user_options()
    assert (gpu.image, gpu.gpu_profile.gpus) == ("pangeo/x:1", 2)
    assert gpu.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100"}
    await gpu.release_gpus_async()
    gpu.user_options = {}
    await gpu.load_user_options()
    stock = KubeSpawner(config=copy.deepcopy(config), _mock=True)
    stock.user_options = {}
    await stock.load_user_options()
    for trait in ("image", "node_selector", "extra_labels",
                  "extra_resource_limits", "cpu_limit", "mem_limit"):
        assert getattr(gpu, trait) == getattr(stock, trait), trait
    # gpulab adds the shared storage's folders (GPULAB_*) to the environment
    assert {k: v for k, v in gpu.environment.items()
            if not k.startswith("GPULAB_")} == stock.environment
    await gpu.release_gpus_async()


@pytest.mark.parametrize("options,message", [
    ({"profile": "test-choices", "image--unlisted-choice": "evil/x:1"}, "Must be a pangeo image"),
    ({"profile": "test-choices", "image": "nope"}, "has no choice 'nope'"),
    ({"profile": "training-r", "image--unlisted-choice": "pangeo/x"}, "Unknown server option"),
    ({"profile": "test-choices", "volume_mounts": []}, "Unknown server option(s): volume_mounts"),
], ids=["regex", "no-such-choice", "option-of-another-profile", "trait"])
async def test_options_kubespawner_would_fail_on_are_refused_with_a_reason(config, options,
                                                                           message):
    gpu = KubeGPUSpawner(config=copy.deepcopy(config), _mock=True)
    gpu.user_options = options
    with pytest.raises(SpawnRefused) as e:
        await gpu.load_user_options()
    assert e.value.status_code == 400 and message in e.value.jupyterhub_message
    assert isinstance(e.value, ValueError)  # what KubeSpawner's own tests expect
    assert not gpu.gpu_claim_id


@pytest.mark.parametrize("spawner_class", [KubeSpawner, KubeGPUSpawner])
async def test_the_form_is_read_as_typed_and_load_user_options_refuses_it(config,
                                                                          spawner_class):
    """KubeSpawner's contract (its tests/test_spawner.py,
    test_user_options_set_from_form_invalid_regex): ``options_from_form`` only builds
    ``user_options``, a typed text that fails ``validation_regex`` included, and
    ``load_user_options`` raises ValueError; the stock spawner and gpulab's alike."""
    s = spawner_class(config=copy.deepcopy(config), _mock=True)
    await s.get_options_form()
    s.user_options = s.options_from_form({
        "profile": ["test-choices"],
        "profile-option-test-choices--image--unlisted-choice": ["invalid/foo:latest"]})
    assert s.user_options == {"profile": "test-choices",
                              "image--unlisted-choice": "invalid/foo:latest"}
    with pytest.raises(ValueError) as e:
        await s.load_user_options()
    if spawner_class is KubeGPUSpawner:  # with the operator's words, for the form to show
        assert e.value.status_code == 400
        assert e.value.jupyterhub_message == ("'invalid/foo:latest' is not allowed for "
                                              "'Image': Must be a pangeo image.")
        assert not s.gpu_claim_id and s.image != "invalid/foo:latest"


async def test_the_form_never_refuses_gpulab_refuses_at_start(config):
    """What gpulab reads more strictly than KubeSpawner (fields it does not know, several
    profiles, a profile nobody has) is still only read by ``options_from_form`` and refused
    by ``load_user_options`` with a 400 the form shows."""
    for form, message in [
        ({"profile": ["nope"]}, "There is no profile 'nope'"),
        ({"profile": ["training-r"], "privileged": ["1"]}, "Unknown server option(s): privileged"),
        ({"profile": ["training-r", "test-choices"]}, "'profile' must be a profile name"),
    ]:
        gpu = KubeGPUSpawner(config=copy.deepcopy(config), _mock=True)
        gpu.user_options = gpu.options_from_form({**form, "_xsrf": ["x"]})
        with pytest.raises(SpawnRefused) as e:
            await gpu.load_user_options()
        assert e.value.status_code == 400 and message in e.value.jupyterhub_message, form
        assert isinstance(e.value, ValueError) and not gpu.gpu_claim_id


# -- the GPU allocation across starts ---------------------------------------------------------

from gpulab.hub.quota.ledger import Request  # noqa: E402
from gpulab.spawner.mixin import hub_ledger  # noqa: E402
from tests.doubles import offline_kubeconfig


async def test_a_start_after_a_failed_one_is_not_refused_for_its_leftover(config):
    """An allocation an earlier start of the same server left open (a spawner JupyterHub
    replaced after the failure, a hub that died) does not refuse the next start with
    "notebook 'default' already holds GPUs": JupyterHub starts only a stopped server."""
    gpu = KubeGPUSpawner(config=copy.deepcopy(config), _mock=True)
    ledger = hub_ledger(gpu.config, assigns_devices=False)
    left = ledger.admit(Request(user=gpu.user.name, kind="notebook", holder="default", gpus=1))
    other = ledger.admit(Request(user=gpu.user.name, kind="notebook", holder="second", gpus=1))
    gpu.user_options = {"profile": "test-choices"}
    await gpu.load_user_options()
    assert gpu.gpu_claim_id and gpu.gpu_claim_id != left.id
    assert ledger.get(left.id).open is False
    assert ledger.get(other.id).open  # another server of the same person keeps its GPUs
    await gpu.release_gpus_async()
    ledger.release(other.id)


async def test_a_start_cancelled_while_admitted_releases_what_it_got(config, monkeypatch):
    """JupyterHub's start_timeout cancels a start; an admission already running in its
    thread still commits, and is then released rather than left open."""
    import asyncio
    import threading
    import time

    from gpulab.hub.quota.ledger import Ledger

    gpu = KubeGPUSpawner(config=copy.deepcopy(config), _mock=True)
    ledger = hub_ledger(gpu.config, assigns_devices=False)
    running, admit = threading.Event(), Ledger.admit

    def slow_admit(self, req, now=None):  # the ledger's lock is busy for a moment
        running.set()
        time.sleep(0.3)
        return admit(self, req, now)

    monkeypatch.setattr(Ledger, "admit", slow_admit)
    gpu.user_options = {"profile": "test-choices"}
    task = asyncio.ensure_future(gpu.load_user_options())
    assert await asyncio.to_thread(running.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if ledger.open_allocations(user=gpu.user.name):
            break
        await asyncio.sleep(0.02)
    for _ in range(100):  # admitted after the cancellation, then released
        if not ledger.open_allocations(user=gpu.user.name):
            break
        await asyncio.sleep(0.05)
    assert ledger.open_allocations(user=gpu.user.name) == []
    assert not gpu.gpu_claim_id


# -- what an attacker's review found (a second account's inputs) ------------------------------


async def test_a_named_server_called_default_is_refused_and_leaves_the_default_servers_gpus(
        config):
    """The ledger names the default server "default": a named server of that name would be
    taken for it, and its start would close the running default server's allocation (quota
    exceeded, its GPUs handed to someone else)."""
    running = KubeGPUSpawner(config=copy.deepcopy(config), _mock=True)
    running.user_options = {"profile": "test-choices"}
    await running.load_user_options()
    held = running.gpu_claim_id
    from types import SimpleNamespace

    # POST /hub/api/users/<name>/servers/default
    named = KubeGPUSpawner(config=copy.deepcopy(config), _mock=True, user=running.user,
                           orm_spawner=SimpleNamespace(name="default", server=None,
                                                        state=None, user_options=None))
    named.user_options = {"profile": "test-choices"}
    with pytest.raises(SpawnRefused) as e:
        await named.load_user_options()
    assert e.value.status_code == 400 and "cannot be called 'default'" in \
        e.value.jupyterhub_message
    ledger = hub_ledger(running.config, assigns_devices=False)
    assert ledger.get(held).open and not named.gpu_claim_id
    await running.release_gpus_async()


async def test_typed_option_text_is_bounded_before_the_operators_regex_runs(config):
    """An operator's validation_regex may backtrack badly (``^([a-z0-9]+[-_.]?)*$`` takes
    minutes on 40 characters): typed text over the bound is refused before it is matched, and
    the refusal does not echo it."""
    import time

    from gpulab.spawner.profiles import MAX_OPTION_TEXT

    cfg = copy.deepcopy(config)
    profiles = copy.deepcopy(PROFILES)
    profiles[2]["profile_options"]["image"]["unlisted_choice"]["validation_regex"] = \
        "^([a-z0-9]+[-_.]?)*$"
    cfg.KubeSpawner.profile_list = profiles
    gpu = KubeGPUSpawner(config=cfg, _mock=True)
    gpu.user_options = {"profile": "test-choices",
                        "image--unlisted-choice": "a" * (MAX_OPTION_TEXT + 1) + "!"}
    t0 = time.monotonic()
    with pytest.raises(SpawnRefused) as e:
        await gpu.load_user_options()
    assert time.monotonic() - t0 < 1
    assert e.value.status_code == 400
    assert f"at most {MAX_OPTION_TEXT} characters" in e.value.jupyterhub_message
    assert len(e.value.jupyterhub_message) < 300


async def test_a_stopped_servers_overrides_are_gone_before_the_next_starts_hooks(config):
    """A hook that writes a trait afresh at every start (an access token in `environment`)
    must not keep the previous start's profile settings in it."""
    gpu = KubeGPUSpawner(config=copy.deepcopy(config), _mock=True)
    gpu.user_options = {"profile": "test-choices", "gpus": "two"}
    await gpu.load_user_options()
    assert gpu.environment["BIG"]
    await gpu.release_gpus_async()
    gpu.clear_state()  # JupyterHub, after the server stopped
    gpu.environment = {**gpu.environment, "ACCESS_TOKEN": "fresh"}  # the next start's hook
    gpu.user_options = {"profile": "training-r"}
    await gpu.load_user_options()
    assert "BIG" not in gpu.environment and gpu.environment["ACCESS_TOKEN"] == "fresh"
    await gpu.release_gpus_async()


@pytest.mark.parametrize("saved", [{"image": ["tf"]}, {"image": ["a", "b"]},
                                   {"image": {"x": 1}}, {"image--unlisted-choice": [{"x": 1}]}])
async def test_odd_saved_options_do_not_break_the_spawn_page(config, saved):
    """Options are saved as sent (also through the API): the next spawn page still renders."""
    gpu = KubeGPUSpawner(config=copy.deepcopy(config), _mock=True)
    gpu.user_options = {"profile": "test-choices", **saved}
    form = await gpu.get_options_form()
    assert 'value="test-choices"' in form


async def test_the_spawn_form_reads_the_ledger_off_the_event_loop(config, monkeypatch):
    """The spawn page's quota summary and profiles (each one's availability) read the ledger
    in a worker thread: the hub's event loop never waits for the ledger's lock."""
    import threading

    from gpulab.hub.quota.ledger import Ledger

    gpu = KubeGPUSpawner(config=copy.deepcopy(config), _mock=True)
    hub_ledger(gpu.config, assigns_devices=False)
    loop_thread, reads = threading.current_thread(), []
    for name in ("open_allocations", "effective"):
        real = getattr(Ledger, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            reads.append((_name, threading.current_thread()))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Ledger, name, spy)
    form = await gpu.get_options_form()
    assert 'value="test-choices"' in form
    assert {n for n, _ in reads} == {"open_allocations", "effective"}
    assert all(thread is not loop_thread for _, thread in reads), reads


@pytest.mark.parametrize("operator", [
    {},
    {"pod_security_context": {"fsGroup": 100}},
    {"pod_security_context": {"seccompProfile": {"type": "Localhost",
                                                  "localhostProfile": "lab.json"}}},
    {"container_security_context": {"seccompProfile": {"type": "Unconfined"}}},
], ids=["nothing", "pod-context", "pod-profile", "container-profile"])
async def test_notebook_pods_run_under_the_runtimes_seccomp_filter_unless_the_operator_chose(
        config, operator):
    """Notebook pods get ``seccompProfile: RuntimeDefault`` on the pod (issue 33: without a
    filter, ``unshare -Urm`` in a pod gave a user namespace with every capability); what an
    operator set for stock KubeSpawner stays: their pod context's other keys, their pod
    profile, their container profile (which Kubernetes applies over the pod's)."""
    for name, value in operator.items():
        setattr(config.KubeSpawner, name, value)
    stock, gpu, (want, got) = await manifests(config, lambda s: {})
    psc_want = want["spec"].get("securityContext") or {}
    psc_got = got["spec"]["securityContext"]
    assert psc_got == {"seccompProfile": {"type": "RuntimeDefault"}, **psc_want}
    assert (got["spec"]["containers"][0].get("securityContext")
            == want["spec"]["containers"][0].get("securityContext"))
    if "seccompProfile" in psc_want:
        assert psc_got["seccompProfile"]["type"] == "Localhost"
    await gpu.release_gpus_async()
