"""helm-values/: the z2jh values name real settings and pass the chart's own schema, the chart's
hub would load the gpulab configuration from them, and the RBAC covers what the spawner does."""

import copy
import json
import os
import stat
import tempfile
from pathlib import Path

import jsonschema
import pytest
import yaml
from jupyterhub.services.service import Service
from kubespawner import KubeSpawner
from traitlets import HasTraits
from traitlets.config import Config

from gpulab.hub.deploy.local import ADMIN_GROUP
from gpulab.hub.deploy.kubernetes import SERVICE_PORT
from gpulab.hub.service import ADMIN_SCOPE, SERVICE_NAME
from gpulab.spawner.kube import KubeGPUSpawner
from gpulab.hub.quota.settings import GPULedger
from gpulab.spawner.profiles import parse_profiles

HELM = Path(__file__).resolve().parents[2] / "helm-values"


@pytest.fixture(scope="module")
def values():
    return yaml.safe_load((HELM / "values.yaml").read_text())


def test_spawner_settings_are_traits(values):
    config = values["hub"]["config"]
    assert config["JupyterHub"]["spawner_class"] == "gpulab.spawner.kube.KubeGPUSpawner"
    from gpulab.hub.jobs.spec import GPUJobs
    from gpulab.hub.jobs.kube import KubeJobBackend

    obj = HasTraits()  # container traits validate against some instance
    for cls, section in ((KubeGPUSpawner, "KubeGPUSpawner"), (GPULedger, "GPULedger"),
                         (GPUJobs, "GPUJobs"), (KubeJobBackend, "KubeJobBackend")):
        traits = cls.class_traits(config=True)
        unknown = sorted(set(config[section]) - set(traits))
        assert not unknown, f"{section}: {unknown} are not settings"
        for name, value in config[section].items():
            if value is None:  # null: the trait's own default, where it allows None
                assert traits[name].allow_none, f"{section}.{name} may not be null"
                continue
            traits[name].validate(obj, value)  # TraitError when the value is malformed


def test_profiles_parse_and_home_storage_is_the_spawners(values):
    profiles = parse_profiles(values["singleuser"]["profileList"])
    assert [(p.slug, p.gpus, p.model) for p in profiles] == [
        ("cpu", 0, None), ("h100-1", 1, "NVIDIA-H100"), ("h100-4", 4, "NVIDIA-H100")]
    assert values["singleuser"]["storage"]["type"] == "none"  # not mounted twice
    assert values["singleuser"]["cloudMetadata"]["blockWithIptables"] is False  # privileged


def test_rbac_binds_the_hub_service_account_to_the_cluster_role():
    role, binding, policy, policy_binding = yaml.safe_load_all((HELM / "rbac.yaml").read_text())
    assert role["kind"] == "ClusterRole" and binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "hub", "namespace": "gpulab"}]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    for needed in [("", "namespaces", "patch"), ("", "resourcequotas", "patch"),
                   ("", "pods", "watch"), ("", "pods", "create"), ("", "events", "watch"),
                   ("", "nodes", "list"), ("", "persistentvolumeclaims", "create"),
                   ("batch", "jobs", "create"), ("networking.k8s.io", "networkpolicies", "patch"),
                   ("networking.k8s.io", "networkpolicies", "create"),
                   ("networking.k8s.io", "networkpolicies", "update")]:
        assert needed in granted, needed
    assert not [x for x in granted if x[1] == "secrets" or x[2] == "*"]  # least privilege
    assert not [x for x in granted if x[0] == "admissionregistration.k8s.io"]  # cannot lift it


def test_the_hubs_writes_are_limited_by_an_admission_policy():
    _, binding, policy, policy_binding = yaml.safe_load_all((HELM / "rbac.yaml").read_text())
    assert policy["apiVersion"] == policy_binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert (policy["kind"], policy_binding["kind"]) == (
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    assert policy_binding["spec"] == {"policyName": policy["metadata"]["name"],
                                      "validationActions": ["Deny"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"  # an error in the policy refuses, never lets through
    # every write of any resource, by the hub's ServiceAccount (the binding's subject) only
    [rule] = spec["matchConstraints"]["resourceRules"]
    assert rule == {"apiGroups": ["*"], "apiVersions": ["*"],
                    "operations": ["CREATE", "UPDATE", "DELETE", "CONNECT"],
                    "resources": ["*/*"]}
    subject = binding["subjects"][0]
    [who] = spec["matchConditions"]
    assert who["expression"] == (f'request.userInfo.username == "system:serviceaccount:'
                                 f'{subject["namespace"]}:{subject["name"]}"')
    # only "may I?" reviews are left out (they change nothing)
    [excluded] = spec["matchConstraints"]["excludeResourceRules"]
    assert excluded["apiGroups"] == ["authorization.k8s.io", "authentication.k8s.io"]
    text = json.dumps(spec)
    for label in ("app.kubernetes.io/managed-by", "gpulab.io/user",
                  "pod-security.kubernetes.io/enforce"):
        assert label in text


# -- the values as the chart sees them: its schema, and its jupyterhub_config.py

# the chart's files, copied unchanged from ../shared/reference/ (see tests/reference/README.md)
Z2JH = Path(__file__).resolve().parents[1] / "reference" / "z2jh"
MANIFESTS = ("rbac.yaml", "shared-volume-nfs.yaml")


def helm_merge(defaults, overrides):
    """What ``helm install -f values.yaml`` hands the templates: maps merged key by key, other
    values (lists included) replaced, and a null removing the chart's key."""
    if not (isinstance(defaults, dict) and isinstance(overrides, dict)):
        return copy.deepcopy(overrides)
    out = copy.deepcopy(defaults)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = helm_merge(out.get(key), value)
    return out


@pytest.fixture(scope="module")
def chart_schema():
    return yaml.safe_load((Z2JH / "values.schema.yaml").read_text())


@pytest.fixture(scope="module")
def chart_values(values):
    return helm_merge(yaml.safe_load((Z2JH / "values.yaml").read_text()), values)


def schema_errors(schema, values) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(values)]


def test_values_validate_against_the_chart_schema(chart_schema, chart_values):
    assert schema_errors(chart_schema, chart_values) == []


@pytest.mark.parametrize("path, wrong", [
    (("hub", "extraConfig"), "extraconfig"),
    (("singleuser", "profileList"), "profilelist"),
    (("cull", "timeout"), "timout"),
    (("scheduling", "userScheduler", "enabled"), "enable"),
    (("hub", "networkPolicy", "ingress"), "ingres"),
    (("hub", "db", "url"), "uri"),
], ids=lambda x: ".".join(x) if isinstance(x, tuple) else x)
def test_a_misspelt_key_fails_the_schema(chart_schema, values, path, wrong):
    mutated = copy.deepcopy(values)
    parent = mutated
    for key in path[:-1]:
        parent = parent[key]
    parent[wrong] = parent.pop(path[-1])
    merged = helm_merge(yaml.safe_load((Z2JH / "values.yaml").read_text()), mutated)
    errors = schema_errors(chart_schema, merged)
    assert any(wrong in e for e in errors), errors


def run_chart_config(values: dict, env: dict, tmp: Path) -> Config:
    """The parts of z2jh's hub jupyterhub_config.py (4.x) that gpulab's settings go through, in
    its order: culler, hub.services (with the chart's generated api token), hub.loadRoles,
    hub.config sections, then each hub.extraConfig snippet exec'd with c and get_config
    (temporary folders, such as the gpulab service's config folder, made in `tmp`)."""
    def get_config(key, default=None):
        value = values
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                return default
            value = value[part]
        return copy.deepcopy(value)

    c = Config()
    c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"
    c.JupyterHub.services = []
    c.JupyterHub.load_roles = []
    if get_config("cull.enabled", False):
        c.JupyterHub.services.append({"name": "jupyterhub-idle-culler", "command": [
            "python3", "-m", "jupyterhub_idle_culler",
            f"--timeout={get_config('cull.timeout')}", f"--cull-every={get_config('cull.every')}"]})
        c.JupyterHub.load_roles.append({"name": "jupyterhub-idle-culler", "scopes": [
            "list:users", "read:users:activity", "read:servers", "delete:servers"],
            "services": ["jupyterhub-idle-culler"]})
    for key, service in get_config("hub.services", {}).items():
        service.setdefault("name", key)
        service.pop("apiToken", None)
        service["api_token"] = "chart-generated-token"
        c.JupyterHub.services.append(service)
    for key, role in get_config("hub.loadRoles", {}).items():
        role.setdefault("name", key)
        c.JupyterHub.load_roles.append(role)
    for section, cfg in get_config("hub.config", {}).items():
        assert section[:1].isupper(), f"hub.config.{section} is not a class name"
        c[section].update(cfg)
    saved, saved_tmp = dict(os.environ), tempfile.tempdir
    os.environ.update(env)
    tempfile.tempdir = str(tmp)
    try:
        for _key, snippet in sorted(get_config("hub.extraConfig", {}).items()):
            exec(snippet, {"c": c, "get_config": get_config})
    finally:
        os.environ.clear()
        os.environ.update(saved)
        tempfile.tempdir = saved_tmp
    return c


LEDGER = "postgresql+psycopg://gpulab:pw@postgres.gpulab.svc.cluster.local:5432/gpulab"


@pytest.fixture(scope="module")
def hub_config(chart_values, tmp_path_factory):
    return run_chart_config(chart_values, {"GPULAB_LEDGER_URL": LEDGER, "POD_IP": "10.1.2.3",
                                           "POD_NAMESPACE": "gpulab"},
                            tmp_path_factory.mktemp("hub"))


def test_extra_config_makes_the_kube_spawner_and_the_ledger(hub_config, values):
    c = hub_config
    assert c.JupyterHub.spawner_class == "gpulab.spawner.kube.KubeGPUSpawner"
    assert c.GPULedger.db_url == LEDGER and c.GPULedger.pool == "kubernetes"
    ledger_conf = GPULedger(config=c)
    assert (ledger_conf.db_url, ledger_conf.pool) == (LEDGER, "kubernetes")
    assert issubclass(KubeGPUSpawner, KubeSpawner)  # c.KubeSpawner (singleuser.*) applies too
    assert dict(c.KubeGPUSpawner) == values["hub"]["config"]["KubeGPUSpawner"]
    # the values' egress rules make valid policies (a rule that is not one fails here)
    from gpulab.hub.cluster.kubeobjects import make_user_network_policies

    rules = values["hub"]["config"]["KubeGPUSpawner"]["allowed_egress"]
    user_pods = make_user_network_policies(namespace="gpulab-ann", user_label="ann",
                                           hub_namespace="gpulab", allowed_egress=rules)[0]
    # no broad rule reaches the clouds' credential endpoints (issue 33): the metadata server
    # anywhere in link-local, Azure's wire server, Alibaba's metadata, the shared address space
    import ipaddress

    endpoints = ["169.254.169.254", "169.254.170.2", "168.63.129.16", "100.100.100.200",
                 "100.64.0.1"]
    for rule in user_pods["spec"]["egress"]:
        for peer in rule.get("to", []):
            block = peer.get("ipBlock")
            if not block:
                continue
            net = ipaddress.ip_network(block["cidr"])
            excepted = [ipaddress.ip_network(e) for e in block.get("except", [])]
            for ep in map(ipaddress.ip_address, endpoints):
                assert ep not in net or any(ep in e for e in excepted), (ep, block)
    assert c.Authenticator.admin_users == {values["custom"]["gpulab"]["firstAdmin"]}
    # z2jh's hub NetworkPolicy lets the proxy in on the port the service listens on
    ports = [p["port"] for rule in values["hub"]["networkPolicy"]["ingress"]
             for p in rule["ports"]]
    assert SERVICE_PORT in ports


def test_extra_config_adds_the_gpulab_service_and_its_roles(hub_config, values):
    c = hub_config
    services = {s["name"]: s for s in c.JupyterHub.services}
    assert set(services) == {"gpulab", "jupyterhub-idle-culler", "prometheus"}
    # Prometheus: a token and no URL (nothing for the proxy to route), for the scrape jobs
    assert "url" not in services["prometheus"] and services["prometheus"]["api_token"]
    gpulab = services["gpulab"]
    assert gpulab["url"] == f"http://10.1.2.3:{SERVICE_PORT}"
    python, m, module, option = gpulab["command"]
    assert (python, m, module) == ("python3", "-m", "gpulab.hub.service")
    assert option.startswith("--config=")
    assert gpulab["api_token"] == "chart-generated-token"  # the chart's entry was completed
    # the settings are in a private file of the hub's (the ledger's password with them), in a
    # folder only the hub's account may enter; the environment has none of them
    path = Path(option.removeprefix("--config="))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.stat().st_uid == os.geteuid()
    env = gpulab["environment"]
    assert env == {"POD_NAMESPACE": "gpulab"}  # the hub's namespace, for the NetworkPolicies
    settings = json.loads(path.read_text())["GpulabService"]
    assert settings["ledger_url"] == LEDGER and settings["ledger_pool"] == "kubernetes"
    assert "shared_dir" not in settings  # no local job backend in the hub pod
    limits = json.loads(settings["job_limits"])
    assert limits["allowed_images"] == values["hub"]["config"]["GPUJobs"]["allowed_images"]
    # the service closes the GPU allocations of servers the (stock) hub lost, every minute
    assert settings["reconcile_seconds"] == 60.0
    assert gpulab["oauth_client_allowed_scopes"] == [ADMIN_SCOPE]
    # notebook servers find the service through the hub's Service and its extra port
    url = c.KubeSpawner.environment["GPULAB_SERVICE_URL"]
    assert url == f"http://hub.gpulab.svc.cluster.local:{SERVICE_PORT}/services/gpulab/"
    assert {"name": "gpulab", "port": SERVICE_PORT, "targetPort": SERVICE_PORT} in \
        values["hub"]["service"]["extraPorts"]
    # training jobs: the Kubernetes backend, in the notebook image, in the spawner's namespaces
    assert settings["job_backend"] == "kubernetes"
    kube_jobs = json.loads(settings["kube_jobs"])
    spawner = values["hub"]["config"]["KubeGPUSpawner"]
    assert kube_jobs["image"] == values["singleuser"]["image"]["name"] + ":" + \
        values["singleuser"]["image"]["tag"]
    assert kube_jobs["image"] in limits["allowed_images"]
    assert kube_jobs["namespace_template"] == spawner["user_namespace_template"]
    assert kube_jobs["shared_volume"] == spawner["shared_volume"]
    assert kube_jobs["allowed_egress"] == spawner["allowed_egress"]
    # every key is a field of JupyterHub's Service, with a valid value (as init_services checks)
    fields = Service.class_traits()
    for key, value in gpulab.items():
        assert key in fields, f"no such service field: {key}"
        fields[key].validate(Service(), value)

    roles = {r["name"]: r for r in c.JupyterHub.load_roles}
    assert set(roles) >= {"gpulab-admin", "gpulab-service", "user", "server",
                          "jupyterhub-idle-culler"}
    admin = roles["gpulab-admin"]
    assert ADMIN_SCOPE in admin["scopes"]
    assert admin["groups"] == [ADMIN_GROUP] and admin["users"] == ["ann"]
    assert f"access:services!service={SERVICE_NAME}" in roles["user"]["scopes"]
    assert f"access:services!service={SERVICE_NAME}" in roles["server"]["scopes"]
    assert ADMIN_SCOPE in c.JupyterHub.custom_scopes
    # Prometheus' token reads the metrics and nothing else
    assert roles["prometheus"]["scopes"] == ["read:metrics"]
    assert roles["prometheus"]["services"] == ["prometheus"]
    # groups come from the identity provider: loading groups too would stop the hub
    assert not c.JupyterHub.get("load_groups")
    assert c.GenericOAuthenticator.manage_groups is True


def test_extra_config_needs_a_ledger_database(chart_values, tmp_path):
    with pytest.raises(ValueError, match="GPULAB_LEDGER_URL"):
        run_chart_config(chart_values, {"GPULAB_LEDGER_URL": ""}, tmp_path)


def test_oidc_settings_are_generic_oauthenticator_traits(values):
    from oauthenticator.generic import GenericOAuthenticator

    config = values["hub"]["config"]
    assert config["JupyterHub"]["authenticator_class"] == "generic-oauth"
    traits = GenericOAuthenticator.class_traits(config=True)
    unknown = sorted(set(config["GenericOAuthenticator"]) - set(traits))
    assert not unknown, unknown
    assert ADMIN_GROUP in config["GenericOAuthenticator"]["admin_groups"]
    assert ADMIN_GROUP in config["GenericOAuthenticator"]["allowed_groups"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifests_are_labelled_kubernetes_objects(name):
    docs = [d for d in yaml.safe_load_all((HELM / name).read_text()) if d]
    assert docs
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), d
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "gpulab"


def test_one_origin_chart_hub_pages_refuse_frames_and_openers(hub_config):
    """The values give no subdomain_host: the chart's hub sends its pages with
    ``frame-ancestors 'none'`` and COOP, so a page of a person's server (same origin) reads no
    hub page, XSRF token included, through a frame or a window it opened (issue 33.3)."""
    settings = hub_config.JupyterHub.tornado_settings
    assert settings["headers"]["Content-Security-Policy"] == "frame-ancestors 'none'"
    assert settings["headers"]["Cross-Origin-Opener-Policy"] == "same-origin"
    assert "static_handler_class" not in settings
    assert "gpulab_service_url" not in hub_config.JupyterHub.get("template_vars", {})


def _static_answer(handler_class, path: str) -> tuple[int, dict]:
    """GET /static/<path> from a real Tornado server with the hub's static files and
    `handler_class`: (status, headers)."""
    import asyncio
    import socket

    import jupyterhub
    from tornado import httpclient, httpserver, web

    static = Path(jupyterhub.__file__).parent.parent / "share" / "jupyterhub" / "static"
    if not static.is_dir():
        from jupyterhub._data import DATA_FILES_PATH

        static = Path(DATA_FILES_PATH) / "static"

    async def fetch():
        app = web.Application([(r"/static/(.*)", handler_class, {"path": str(static)})])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = httpserver.HTTPServer(app)
        server.listen(port, "127.0.0.1")
        try:
            r = await httpclient.AsyncHTTPClient().fetch(
                f"http://127.0.0.1:{port}/static/{path}", raise_error=False)
            return r.code, dict(r.headers)
        finally:
            server.stop()

    return asyncio.run(fetch())


def test_subdomain_chart_hub_shares_its_static_files_and_links_the_services_host(
        chart_values, tmp_path):
    """With ``hub.config.JupyterHub.subdomain_host`` (docs/deploy-kubernetes.md) the chart's
    hub serves its static files to every origin (the gpulab service's pages on their own host
    load the hub's CSS and fonts, fonts with CORS), links "GPUs" to the service's host as
    JupyterHub names it, and keeps its cookies ``__Host-`` on HTTPS; the one-origin headers
    are left out (each server has an origin of its own)."""
    from jupyterhub.handlers.static import CacheControlStaticFilesHandler
    from jupyterhub.utils import subdomain_hook_idna

    v = copy.deepcopy(chart_values)
    v["hub"]["config"]["JupyterHub"]["subdomain_host"] = "https://gpulab.example.org"
    c = run_chart_config(v, {"GPULAB_LEDGER_URL": LEDGER, "POD_IP": "10.1.2.3"}, tmp_path)
    settings = c.JupyterHub.tornado_settings
    assert "Content-Security-Policy" not in settings.get("headers", {})
    handler = settings["static_handler_class"]
    assert issubclass(handler, CacheControlStaticFilesHandler)
    code, headers = _static_answer(handler, "css/style.min.css")
    assert code == 200 and headers["Access-Control-Allow-Origin"] == "*", (code, headers)
    code, headers = _static_answer(CacheControlStaticFilesHandler, "css/style.min.css")
    assert code == 200 and "Access-Control-Allow-Origin" not in headers
    service = subdomain_hook_idna(SERVICE_NAME, "gpulab.example.org", "service")
    assert c.JupyterHub.template_vars["gpulab_service_url"] == \
        f"https://{service}/services/{SERVICE_NAME}/"
    assert c.JupyterHub.cookie_host_prefix_enabled is True
    # an operator's own choice stays
    v["hub"]["config"]["JupyterHub"].update(subdomain_host="http://lab.example.org:8000",
                                            cookie_host_prefix_enabled=False)
    (tmp_path / "again").mkdir()
    c = run_chart_config(v, {"GPULAB_LEDGER_URL": LEDGER, "POD_IP": "10.1.2.3"},
                         tmp_path / "again")
    assert c.JupyterHub.cookie_host_prefix_enabled is False
    assert c.JupyterHub.template_vars["gpulab_service_url"] == \
        f"http://{subdomain_hook_idna(SERVICE_NAME, 'lab.example.org', 'service')}:8000" \
        f"/services/{SERVICE_NAME}/"


def test_the_charts_hub_is_gpulabs_and_reads_the_charts_config(values, tmp_path):
    """``hub.args`` start `GpulabKubeHub` (JupyterHub with gpulab's guard) on the chart's
    config file, with JupyterHub's own options."""
    from gpulab.hub.deploy.kubehub import GpulabKubeHub

    args = values["hub"]["args"]
    assert args == ["python3", "-m", "gpulab.hub.deploy.kubehub",
                    "--config", "/usr/local/etc/jupyterhub/jupyterhub_config.py"]
    here = tmp_path / "jupyterhub_config.py"  # the chart's, where this test can make one
    here.write_text("")
    hub = GpulabKubeHub()
    hub.parse_command_line([args[3], str(here)])
    assert hub.config_file == str(here)


def _answers(app, requests_: list[tuple[str, dict]]) -> list[int]:
    """The statuses a real Tornado server of `app` answers to PATCH /hub/api/users/eve with
    each of `requests_`'s (name, headers)."""
    import asyncio
    import socket

    from tornado import httpclient, httpserver

    async def send():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = httpserver.HTTPServer(app)
        server.listen(port, "127.0.0.1")
        try:
            out = []
            for _name, headers in requests_:
                headers = {k: v.format(host=f"127.0.0.1:{port}") for k, v in headers.items()}
                r = await httpclient.AsyncHTTPClient().fetch(
                    f"http://127.0.0.1:{port}/hub/api/users/eve", method="PATCH",
                    body='{"admin": true}', headers=headers, raise_error=False)
                out.append(r.code)
            return out
        finally:
            server.stop()

    return asyncio.run(send())


def test_the_charts_hub_refuses_what_a_servers_page_sends_on_one_origin(hub_config):
    """Without subdomain_host (the values' default) the chart's hub (`GpulabKubeHub`) refuses,
    before any handler of the hub's runs, a change sent by a page below /user/ (issue 33.3);
    the same request from the hub's own page reaches the handler."""
    from tornado import web

    from gpulab.hub.deploy.kubehub import GpulabKubeHub
    from gpulab.hub.deploy.userpages import UserPagesGuard

    reached = []

    class Users(web.RequestHandler):
        def check_xsrf_cookie(self):
            pass

        def patch(self, name):
            reached.append(name)
            self.finish({"name": name})

    hub = GpulabKubeHub(config=hub_config)
    assert hub.refuse_user_pages and not hub.subdomain_host
    hub.handlers = [(r"/hub/api/users/(.*)", Users)]
    hub.init_tornado_application()
    assert isinstance(hub.tornado_application, UserPagesGuard)
    page = "http://{host}/user/eve/proxy/9000/plot.html"
    codes = _answers(hub.tornado_application, [
        ("from eve's page", {"Referer": page, "Sec-Fetch-Site": "same-origin"}),
        ("hiding its address", {"Sec-Fetch-Site": "same-origin", "Origin": "null"}),
        ("from the hub's page", {"Referer": "http://{host}/hub/admin"}),
    ])
    assert codes == [403, 403, 200] and reached == ["eve"], (codes, reached)
    # with subdomain_host JupyterHub's own application, the static files shared
    c = copy.deepcopy(hub_config)
    c.JupyterHub.subdomain_host = "https://gpulab.example.org"
    hub = GpulabKubeHub(config=c)
    from jupyterhub.handlers.static import CacheControlStaticFilesHandler

    hub.handlers, hub._service_map = [(r"/hub/api/users/(.*)", Users)], {}
    hub.tornado_settings = {"static_handler_class": CacheControlStaticFilesHandler}
    hub.init_tornado_application()
    assert not isinstance(hub.tornado_application, UserPagesGuard)
    assert hub.tornado_settings["static_handler_class"].gpulab_shared
