"""gpulab as a system service: the unit file (`gpulab.hub.deploy.systemd.unit_text`, a pure
function compared with a literal), how words are written into it, and which `gpulab up` flags
`gpulab service install` puts on its command line. The command itself, and the unit it
writes checked by `systemd-analyze verify`, are in tests/app/test_service_cli.py."""

import os
import subprocess

import pytest

from gpulab.hub.cli import build_parser
from gpulab.hub.cli.service import hub_outside_service, up_flags
from gpulab.hub.deploy.systemd import UnitError, quote, systemd_running, unit_text

EXPECTED = """\
# gpulab's hub as a system service, written by `gpulab service install`: run that again with
# other `gpulab up` flags to change it, `gpulab service uninstall` to remove it.
[Unit]
Description=gpulab: a JupyterHub for shared GPUs
Wants=network-online.target
After=network-online.target

[Service]
Type=exec
ExecStart=/opt/gpulab/venv/bin/gpulab up --port 8080 --data-dir "/srv/lab data/100%%"
Environment=PATH=/opt/gpulab/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
Environment=PYTHONUNBUFFERED=1
# logs: journalctl -u gpulab (and <data-dir>/logs/hub.log)
StandardOutput=journal
StandardError=journal
SyslogIdentifier=gpulab
Restart=on-failure
RestartSec=5s
# stop: SIGTERM to the hub alone, which stops every server itself; SIGKILL to what is left
KillMode=mixed
TimeoutStopSec=90s
# cgroup v2: servers' and replicas' groups go inside the service's own group
Delegate=yes
# everybody's servers are tasks of this unit: gpulab bounds each one, not all together
TasksMax=infinity
UMask=0077
RestrictRealtime=yes
CapabilityBoundingSet=~CAP_SYS_BOOT CAP_SYS_TIME CAP_WAKE_ALARM

[Install]
WantedBy=multi-user.target
"""


def test_the_unit_file():
    text = unit_text(
        command=["/opt/gpulab/venv/bin/gpulab", "up", "--port", "8080",
                 "--data-dir", "/srv/lab data/100%"],
        path=["/opt/gpulab/venv/bin", "/usr/local/sbin", "/usr/local/bin", "/usr/sbin",
              "/usr/bin", "/sbin", "/bin"])
    assert text == EXPECTED


@pytest.mark.parametrize("word,written", [
    ("/var/lib/gpulab", "/var/lib/gpulab"),
    ("--admin-user", "--admin-user"),
    ("a b", '"a b"'),
    ("50%", "50%%"),  # a systemd specifier otherwise (%h, %n...)
    ("$HOME", '"$$HOME"'),  # a variable otherwise
    ('say "hi"\\', '"say \\"hi\\"\\\\"'),
    ("", '""'),
    (";", '";"'),  # a separator of commands otherwise
], ids=["path", "flag", "space", "percent", "dollar", "quotes-backslash", "empty", "semicolon"])
def test_words_on_the_command_line(word, written):
    assert quote(word) == written


def test_an_assignment_keeps_its_dollars():
    assert quote("PATH=/a $b", expand_variables=False) == '"PATH=/a $b"'


@pytest.mark.parametrize("command", [["/bin/gpulab", "up", "--admin-user", "a\nb"],
                                     ["gpulab", "up"], []],
                         ids=["newline", "relative-program", "empty"])
def test_what_a_unit_cannot_hold_is_refused(command):
    with pytest.raises(UnitError):
        unit_text(command=command, path=["/usr/bin"])


def install_args(*argv):
    return build_parser().parse_args(["service", "install", *argv])


def test_install_writes_only_the_flags_given_and_an_absolute_data_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GPULAB_DATA_DIR", raising=False)
    args = install_args("--no-isolation", "--port", "8080", "--data-dir", "d",
                        "--shared-dir", "s", "--idle-timeout", "3600", "--log-level", "DEBUG")
    # in `gpulab up -h`'s order; --idle-timeout 3600 is the default, so left out
    assert up_flags(args) == ["--port", "8080", "--data-dir", str(tmp_path / "d"),
                              "--shared-dir", str(tmp_path / "s"), "--no-isolation",
                              "--log-level", "DEBUG"]


def test_the_data_folder_is_written_even_when_not_given(monkeypatch):
    """The service must not depend on the installer's environment: the folder `gpulab up`
    would use as root is written out."""
    monkeypatch.delenv("GPULAB_DATA_DIR", raising=False)
    assert up_flags(install_args()) == ["--data-dir", "/var/lib/gpulab"]
    monkeypatch.setenv("GPULAB_DATA_DIR", "/srv/gpulab")
    assert up_flags(install_args("--ip", "0.0.0.0")) == ["--ip", "0.0.0.0",
                                                         "--data-dir", "/srv/gpulab"]


def test_install_takes_every_flag_of_up():
    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices
    install = subs["service"]._subparsers._group_actions[0].choices["install"]
    up_flags_ = {s for a in subs["up"]._actions for s in a.option_strings}
    install_flags = {s for a in install._actions for s in a.option_strings}
    assert install_flags == up_flags_ | {"--root"}


def test_systemd_is_running_where_it_booted_the_machine(tmp_path):
    assert not systemd_running(str(tmp_path))
    (tmp_path / "run" / "systemd" / "system").mkdir(parents=True)
    assert systemd_running(str(tmp_path))


def test_a_hub_run_by_hand_on_the_data_folder_is_found(tmp_path):
    """Where the service would start, a hub already running on its data folder (outside
    gpulab.service) refuses the install: the service's hub would fail again and again."""
    assert hub_outside_service(str(tmp_path)) is None  # no pid file
    (tmp_path / "jupyterhub.pid").write_text(str(os.getpid()))  # this process stands in
    assert hub_outside_service(str(tmp_path)) == os.getpid()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "jupyterhub.pid").write_text(str(dead.pid))
    assert hub_outside_service(str(tmp_path)) is None
