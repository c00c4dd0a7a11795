"""A program of several files from the notebook side: `build_spec(files=…)`, `read_files` and
the cell magic's ``--file`` (the CLI's ``--source-file`` is in test_jobs_export.py, the
service's rules in test_jobspec.py)."""

import pytest

from gpulab.extensions import jobmodel as jm
from gpulab.extensions import magics
from gpulab.hub.jobs.spec import parse_spec


@pytest.fixture
def folder(tmp_path, monkeypatch):
    (tmp_path / "mnist_setup.py").write_text("X = 1\n")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "params.json").write_text("{}")
    (tmp_path / "cfg" / "mnist_setup.py").write_text("X = 2\n")
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00")
    monkeypatch.chdir(tmp_path)  # a notebook's kernel runs in the notebook's folder
    return tmp_path


def test_build_spec_takes_files_as_texts_or_as_paths(folder):
    spec = jm.build_spec(name="mw", strategy="multi-worker-mirrored", workers=2,
                         source="import mnist_setup\n", files=["mnist_setup.py",
                                                               "cfg/params.json"])
    assert spec["files"] == {"mnist_setup.py": "X = 1\n", "params.json": "{}"}
    assert parse_spec(spec).files == spec["files"]  # what the service accepts
    same = jm.build_spec(name="mw", source="x", files={"a.py": "A = 1"})
    assert same["files"] == {"a.py": "A = 1"}
    assert "files" not in jm.build_spec(name="mw", source="x", files=[])


@pytest.mark.parametrize("paths,words", [
    (["missing.py"], "cannot read missing.py"),
    (["mnist_setup.py", "cfg/mnist_setup.py"], "two files are named mnist_setup.py"),
    (["blob.bin"], "blob.bin is not UTF-8 text"),
])
def test_read_files_says_what_is_wrong_in_one_line(folder, paths, words):
    with pytest.raises(ValueError, match=words):
        jm.read_files(paths)


def test_magic_sends_files_of_the_notebooks_folder_with_the_cell(folder):
    spec, _ = magics.parse_train_line(
        "--name mnist --strategy multi-worker-mirrored --workers 2 --file mnist_setup.py "
        "--file cfg/params.json", "import mnist_setup\n")
    assert spec["source"] == "import mnist_setup\n"
    assert spec["files"] == {"mnist_setup.py": "X = 1\n", "params.json": "{}"}
    with pytest.raises(magics.ArgError) as e:
        magics.parse_train_line("--file nope.py", "print(1)")
    assert str(e.value) == "%%gpulab_train: --file: cannot read nope.py: No such file or directory"
