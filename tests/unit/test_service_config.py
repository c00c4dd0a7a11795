"""The gpulab service's config file (`gpulab.hub.deploy.serviceconfig`): private from its
creation, read back by the real `GpulabService` application, written by both deployments'
builders, and the operator's environment for the service keeps its precedence."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from traitlets.config import Config

from gpulab.hub.deploy import serviceconfig
from gpulab.hub.deploy.datadir import DataDir
from gpulab.hub.deploy.kubernetes import kubernetes_config
from gpulab.hub.deploy.local import LocalSettings, gpulab_service_settings, local_essentials
from gpulab.hub.deploy.serviceconfig import (SERVICE_CONFIG_NAME, service_config,
                                             write_service_config)
from gpulab.hub.service import ENV_FALLBACKS
from gpulab.hub.service.app import GpulabService

#: a value for every setting, none of them its default
SETTINGS = {
    "ledger_url": "postgresql+psycopg://gpulab:s3cret@db:5432/gpulab",
    "ledger_pool": "kubernetes",
    "job_limits": '{"max_replicas_per_user": 3}',
    "reconcile_seconds": 7.5,
    "usage_seconds": 0.0,
    "job_backend": "kubernetes",
    "kube_jobs": '{"namespace_template": "team-{username}"}',
    "shared_dir": "/srv/shared",
    "isolate": True,
    "user_prefix": "gl-",
    "job_python": "/opt/tf/bin/python",
    "ssl_keyfile": "/tls/svc.key",
    "ssl_certfile": "/tls/svc.crt",
    "ssl_client_ca": "/tls/trust.crt",
    "ssl_hub_ca": "/tls/hub-ca.crt",
    "queue": '{"half_life_hours": 24.0}',
    "usage_source": '{"source": "dcgm", "dcgm_url": "http://dcgm:9400/metrics"}',
    "idle": '{"default": {"mode": "warn"}}',
}


@pytest.fixture
def clean_env(monkeypatch):
    """No GPULAB_* setting in this process's environment; returns a setter for some."""
    for name in ENV_FALLBACKS.values():
        monkeypatch.delenv(name, raising=False)

    def set_env(env: dict) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_env


def load_service(config_file) -> GpulabService:
    """The real application, started as the hub starts it (``--config=<file>``), its
    settings read (defaults fall back to the environment as they are read)."""
    app = GpulabService()
    app.initialize([f"--config={config_file}"])
    return app


def test_every_setting_is_a_trait_with_its_environment_fallback(clean_env):
    traits = GpulabService.class_traits(config=True)
    assert set(SETTINGS) == set(ENV_FALLBACKS)
    assert set(ENV_FALLBACKS) <= set(traits)
    env = {ENV_FALLBACKS[name]: ("1" if name == "isolate" else str(value))
           for name, value in SETTINGS.items()}
    clean_env(env)
    app = GpulabService()
    app.initialize([])
    assert {name: getattr(app, name) for name in SETTINGS} == SETTINGS


def test_the_file_is_private_from_its_creation_and_replaced_atomically(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir(mode=0o711)
    path = folder / SERVICE_CONFIG_NAME
    # an older file there, readable by all: replaced by a new file, never rewritten in place
    path.write_text("{}")
    os.chmod(path, 0o644)
    old_inode = path.stat().st_ino
    seen = []
    real_replace = os.replace

    def replace(src, dst):  # the real rename, looked at just before it happens
        info = os.lstat(src)
        seen.append((Path(src).parent, stat.S_IMODE(info.st_mode), info.st_uid,
                     json.loads(Path(src).read_text())))
        return real_replace(src, dst)

    monkeypatch.setattr(serviceconfig.os, "replace", replace)
    old_umask = os.umask(0)  # the most permissive umask: the mode comes from the code alone
    try:
        write_service_config(path, SETTINGS)
    finally:
        os.umask(old_umask)
    # the file was whole and 0600 under its temporary name, before anyone could find it
    assert seen == [(folder, 0o600, os.geteuid(), {"GpulabService": SETTINGS})]
    info = path.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    assert info.st_ino != old_inode
    assert sorted(p.name for p in folder.iterdir()) == [SERVICE_CONFIG_NAME]  # no temp left


def test_a_link_in_place_of_the_file_is_replaced_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    folder = tmp_path / "data"
    folder.mkdir(mode=0o700)
    (folder / SERVICE_CONFIG_NAME).symlink_to(target)
    write_service_config(folder / SERVICE_CONFIG_NAME, {"ledger_url": "sqlite://"})
    assert target.read_text() == "untouched"
    assert not (folder / SERVICE_CONFIG_NAME).is_symlink()


def test_a_folder_others_may_write_to_is_refused(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(PermissionError, match="closed to others' writes"):
        write_service_config(folder / SERVICE_CONFIG_NAME, {"ledger_url": "sqlite://"})
    assert list(folder.iterdir()) == []


def test_a_name_that_is_no_setting_is_refused():
    with pytest.raises(ValueError, match="Not settings of the gpulab service: ledger"):
        service_config({"ledger": "sqlite://"})


def test_the_file_round_trips_into_the_service_and_wins_over_the_environment(tmp_path,
                                                                              clean_env):
    path = write_service_config(tmp_path / SERVICE_CONFIG_NAME, SETTINGS)
    # a service environment with other values: the file's win
    clean_env({"GPULAB_LEDGER_URL": "sqlite:////elsewhere.sqlite",
               "GPULAB_RECONCILE_SECONDS": "99", "GPULAB_ISOLATE": "0"})
    app = load_service(path)
    assert {name: getattr(app, name) for name in SETTINGS} == SETTINGS
    # what the file leaves out (None) still comes from the environment
    path = write_service_config(tmp_path / SERVICE_CONFIG_NAME,
                                {**SETTINGS, "reconcile_seconds": None})
    assert load_service(path).reconcile_seconds == 99.0


def test_the_local_service_is_started_with_its_config_file(tmp_path):
    data = DataDir.at(tmp_path / "data")
    data.prepare()
    s = LocalSettings(data=data, isolate_users=True, user_prefix="gl-")
    services = {e["name"]: e for e in local_essentials(s).JupyterHub.services}
    gpulab = services["gpulab"]
    assert gpulab["command"] == [sys.executable, "-m", "gpulab.hub.service",
                                 f"--config={data.path / SERVICE_CONFIG_NAME}"]
    assert data.service_config_file == data.path / SERVICE_CONFIG_NAME
    assert not gpulab.get("environment")  # the settings are in the file
    assert gpulab_service_settings(s) == {
        "ledger_url": data.ledger_url, "ledger_pool": "local", "shared_dir": str(data.shared),
        "isolate": True, "user_prefix": "gl-"}


def test_the_local_hub_gathers_the_operators_settings_and_keeps_its_environment(tmp_path,
                                                                                clean_env):
    """`gpulab up`'s hub: the operator's file decides the limits, intervals and the jobs'
    Python; variables the operator gives the service reach it, but gpulab's own settings
    (the ledger, the shared folder…) still win over them, as they did as variables."""
    from gpulab.hub.deploy.localhub import GpulabHub

    data = DataDir.at(tmp_path / "data")
    data.prepare()
    s = LocalSettings(data=data)
    data.config_file.write_text(
        "c.GPULedger.reconcile_interval = 30\n"
        "c.GPUJobs.python = '/opt/tf/bin/python'\n"
        "c.JupyterHub.services = [{'name': 'gpulab', 'environment': {\n"
        "    'TEAM': 'vision', 'GPULAB_LEDGER_URL': 'sqlite:////elsewhere.sqlite',\n"
        "    'GPULAB_JOB_BACKEND': 'kubernetes', 'GPULAB_KUBE_JOBS': '{}'}}]\n")
    hub = GpulabHub()
    hub.gpulab_essentials = local_essentials(s)
    hub.gpulab_service_config = data.service_config_file
    hub.gpulab_service_settings = gpulab_service_settings(s)
    hub.load_config_file(str(data.config_file))
    gpulab = next(e for e in hub.services if e["name"] == "gpulab")
    assert gpulab["command"][-1] == f"--config={data.service_config_file}"
    env = gpulab["environment"]
    assert env == {"TEAM": "vision", "GPULAB_LEDGER_URL": "sqlite:////elsewhere.sqlite",
                   "GPULAB_JOB_BACKEND": "kubernetes", "GPULAB_KUBE_JOBS": "{}"}
    # what init_services writes before it starts the service
    path = write_service_config(hub.gpulab_service_config, hub._service_settings)
    clean_env(env)
    app = load_service(path)
    assert app.ledger_url == data.ledger_url  # gpulab's, as before
    assert app.reconcile_seconds == 30.0 and app.job_python == "/opt/tf/bin/python"
    assert json.loads(app.job_limits)["max_replicas_per_user"] >= 1
    assert app.shared_dir == str(data.shared) and app.ledger_pool == "local"
    # settings gpulab up leaves unset come from the operator's variables (tests/cluster runs
    # the local hub's jobs on Kubernetes so)
    assert app.job_backend == "kubernetes" and app.kube_jobs == "{}"


def test_kubernetes_keeps_the_operators_service_environment_in_charge(tmp_path, clean_env,
                                                                      monkeypatch):
    """On Kubernetes the operator's ``environment`` for the gpulab service always won over
    gpulab's variables: the file leaves those settings out, so it still does."""
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    c = Config()
    c.JupyterHub.services = [{"name": "gpulab", "environment": {
        "GPULAB_RECONCILE_SECONDS": "5", "TEAM": "vision"}}]
    kubernetes_config(c, ledger_url="postgresql+psycopg://gpulab:pw@db/gpulab",
                      service_ip="10.0.0.1", config_dir=tmp_path / "hub" / "service")
    gpulab = next(e for e in c.JupyterHub.services if e["name"] == "gpulab")
    option = gpulab["command"][-1]
    path = Path(option.removeprefix("--config="))
    assert path == tmp_path / "hub" / "service" / SERVICE_CONFIG_NAME
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    settings = json.loads(path.read_text())["GpulabService"]
    assert "reconcile_seconds" not in settings
    assert gpulab["environment"] == {"GPULAB_RECONCILE_SECONDS": "5", "TEAM": "vision"}
    clean_env(gpulab["environment"])
    app = load_service(path)
    assert app.reconcile_seconds == 5.0  # the operator's
    assert app.ledger_url == "postgresql+psycopg://gpulab:pw@db/gpulab"  # from the file
    assert app.ledger_pool == "kubernetes" and app.job_backend == "kubernetes"
    assert json.loads(app.kube_jobs) == json.loads(settings["kube_jobs"])


def test_the_kubernetes_config_folder_must_be_the_hubs(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(PermissionError, match="not a folder of this account"):
        kubernetes_config(Config(), ledger_url="sqlite://", service_ip="10.0.0.1",
                          config_dir=link)
