"""docs/from-a-tensorflow-tutorial.md matches the code: the README links it, the examples it
names exist, the `gpulab jobs submit` commands it shows make valid specs (rendered with
`gpulab jobs export`, no hub needed), and the runtime helpers it names exist."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from gpulab.extensions import runtime
from gpulab.hub.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "from-a-tensorflow-tutorial.md"
TEXT = PAGE.read_text()


def submit_commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", TEXT, re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [" ".join(ln.split()) for ln in lines if ln.strip().startswith("gpulab jobs submit")]


def test_the_readme_links_the_page():
    assert "(docs/from-a-tensorflow-tutorial.md)" in (ROOT / "README.md").read_text()


def test_the_examples_it_names_exist():
    named = set(re.findall(r"examples/[\w./-]+", TEXT))
    assert named and all((ROOT / n.rstrip("/.")).exists() for n in named), named


@pytest.mark.parametrize("command", [c for c in submit_commands() if "examples/" in c])
def test_its_submit_commands_make_valid_specs(command, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = [a for a in shlex.split(command)[3:] if a != "-f"]
    rc = main(["jobs", "export", "--format", "tfjob", "--user", "ann", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    docs = list(yaml.safe_load_all(out))
    assert docs[0]["kind"] == "ConfigMap" and "source.py" in docs[0]["data"]
    if "tutorial_multi_worker" in command:  # the folder: main.py the entry, its helper beside
        assert docs[0]["data"]["source.py"] == (
            ROOT / "examples/tutorial_multi_worker/main.py").read_text()
        assert set(docs[0]["data"]) == {"source.py", "mnist_setup.py"}


def test_the_runtime_helpers_it_names_exist():
    named = set(re.findall(r"runtime\.(\w+)\(", TEXT))
    assert {"logdir", "checkpoint_dir", "strategy", "writable_dir", "task"} <= named
    assert all(callable(getattr(runtime, n, None)) for n in named), named
