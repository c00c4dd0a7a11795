"""scripts/stamp.py: when scripts/setup.sh installs again (issue 37: run.sh reinstalled after
test.sh had installed more extras, so the two commands undid each other)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stamp.py"
spec = importlib.util.spec_from_file_location("gpulab_setup_stamp", SCRIPT)
stamp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stamp)

CASES = [
    # (installed stamp, asked for, sources now, what to install: None = nothing)
    ("tf,test abc", "tf", "abc", None),                     # run.sh after test.sh
    ("tf,test abc", "tf,test", "abc", None),                # test.sh again
    ("tf abc", "tf,test", "abc", "test,tf"),                # test.sh after run.sh: adds test
    ("tf,test abc", "tf", "def", "test,tf"),                # sources changed: keeps test
    ("tf-cuda abc", "tf", "abc", None),                     # CUDA's TensorFlow serves tf
    ("tf abc", "tf-cuda", "abc", "tf-cuda"),                # but not the other way round
    ("", "tf", "abc", "tf"),                                # never installed
    ("tf,test", "tf", "abc", "tf"),                         # a damaged stamp: install
]


@pytest.mark.parametrize("installed,asked,sources,todo", CASES,
                         ids=[f"{c[0] or 'none'}->{c[1]}@{c[2]}" for c in CASES])
def test_plan(installed, asked, sources, todo):
    assert stamp.plan(installed, asked, sources) == todo


def test_the_command_setup_sh_runs(tmp_path):
    """The way setup.sh calls it: a missing stamp file means install; the stamp it then
    writes (`line`) serves a later, smaller request."""
    f = tmp_path / ".gpulab-installed"

    def run(extras):
        r = subprocess.run([sys.executable, str(SCRIPT), str(f), extras, "h1"],
                           capture_output=True, text=True, check=True)
        return r.stdout.strip()

    assert run("tf,test") == "install test,tf"
    f.write_text(stamp.line("tf,test", "h1") + "\n")
    assert run("tf") == "ok"
    assert run("tf,test") == "ok"
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 2 and "stamp.py" in r.stderr
