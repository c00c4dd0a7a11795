"""schemathesis against the served OpenAPI document: generated requests (valid and invalid,
as a gpulab admin) never get a 5xx from the gpulab service.

Job submission is left out here: a valid generated spec would start real training processes
by the dozen. tests/security/test_fuzz_stateful.py generates them too, on a hub whose operator
bounds the replicas a person may run, in stateful sequences with hostile files between calls.
Bad job specs are also covered by the table in test_jobs_api.py and
tests/unit/test_jobspec.py."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.app

ST = str(Path(sys.executable).with_name("schemathesis"))
#: schemathesis with ``*.localhost`` on loopback (hubctl's resolver), for a hub with
#: subdomains (the service on ``gpulab--service.localhost``), which the system's resolver does
#: not know
ST_LOOPBACK = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); "
               "import tests.app.hubctl; from schemathesis.cli import schemathesis; "
               "sys.argv[0] = 'schemathesis'; sys.exit(schemathesis())",
               str(Path(__file__).resolve().parents[2])]


def test_no_server_errors_from_generated_requests(hub, admin):
    r = subprocess.run(
        [*(ST_LOOPBACK if hub.subdomains else [ST]), "run", hub.service_api + "openapi.json", "--url", hub.service_api.rstrip("/"),
         "-H", f"Authorization: token {admin.token()}", "--checks", "not_a_server_error",
         "--max-examples", "60",
         "--exclude-name", "POST /jobs", "--seed", "1", "--workers", "2", "--warnings", "off"],
        capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    m = re.search(r"(\d+) generated, (\d+) passed", r.stdout)
    assert m, r.stdout[-3000:]
    assert int(m.group(1)) >= 500 and m.group(1) == m.group(2), r.stdout[-3000:]
