"""images/: the Dockerfiles parse, their bases are pinned by tag (the hub on z2jh's hub image of
JupyterHub 5.5, the notebook image on the CUDA and cuDNN of TensorFlow's GPU build), they install
exactly the versions the test suite runs, run unprivileged, and what they start exists.

No container engine runs here: these are the checks that can be made without building."""

import importlib.metadata as md
import importlib.util
import re
import runpy
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
KNOWN = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
         "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    assert not current, f"unfinished instruction: {current!r}"
    return out


@pytest.fixture(scope="module", params=["hub", "singleuser"])
def image(request):
    text = (IMAGES / request.param / "Dockerfile").read_text()
    return request.param, parse_dockerfile(text)


def test_dockerfile_parses_and_every_copied_path_exists(image):
    name, steps = image
    assert steps and all(word in KNOWN for word, _ in steps), steps
    assert [w for w, _ in steps if w != "ARG"][0] == "FROM"
    for word, args in steps:
        if word == "COPY":
            *sources, _dest = shlex.split(args)
            for src in sources:
                assert (ROOT / src).exists(), f"{name}: COPY {src}: no such path"


def test_images_copy_every_folder_pyproject_installs_from(image):
    """pip installs gpulab from the copied source: each package folder and data-file folder of
    pyproject.toml must be there (a missing one fails the image's build; ``gpulab-top``, the
    top-level ``gpulab`` package, once was)."""
    name, steps = image
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    needed = {d.split("/")[0] for d in setup["package-dir"].values()}
    needed |= {f.split("/")[0] for files in setup["data-files"].values() for f in files}
    copied = set()
    for word, args in steps:
        if word == "COPY":
            *sources, dest = shlex.split(args)
            if dest.rstrip("/").endswith("/src") or "/src/" in dest:
                copied |= {s.split("/")[0] for s in sources}
    assert needed <= copied, f"{name}: pyproject installs from {sorted(needed - copied)}, " \
                             "which the Dockerfile does not copy"


def base_image(steps) -> str:
    [base] = [args.split()[0] for word, args in steps if word == "FROM"]
    return base


def test_base_is_pinned_by_tag(image):
    name, steps = image
    base = base_image(steps)
    repo, _, tag = base.rpartition(":")
    assert repo and tag and "/" not in tag and tag != "latest" and "$" not in base, base


def test_hub_base_is_the_z2jh_hub_of_jupyterhub_5_5():
    steps = parse_dockerfile((IMAGES / "hub" / "Dockerfile").read_text())
    # z2jh 4.4.0's chart appVersion is 5.5.0: its hub image ships JupyterHub 5.5.0
    assert base_image(steps) == "quay.io/jupyterhub/k8s-hub:4.4.0"
    assert re.fullmatch(r"5\.5\.\d+", pinned("requirements.txt")["jupyterhub"])


def tensorflow_build_info() -> dict:
    """TensorFlow's build_info.py, read without importing TensorFlow (which takes seconds)."""
    for dist in ("tensorflow",):
        try:
            path = md.distribution(dist).locate_file("tensorflow/python/platform/build_info.py")
        except md.PackageNotFoundError:
            continue
        if Path(path).exists():
            return runpy.run_path(str(path))["build_info"]
    pytest.fail("TensorFlow is not installed (scripts/test.sh installs gpulab[tf])")


def test_singleuser_base_has_the_cuda_of_tensorflows_gpu_build():
    steps = parse_dockerfile((IMAGES / "singleuser" / "Dockerfile").read_text())
    base = base_image(steps)
    m = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-cudnn-runtime-ubuntu[\d.]+", base)
    assert m, base
    info = tensorflow_build_info()
    assert info["is_cuda_build"]
    assert m.group(1) == info["cuda_version"]  # CUDA 12.5.1 for TensorFlow 2.21
    assert info["cudnn_version"] == "9"  # the CUDA 12.5 "cudnn" images carry cuDNN 9


def pinned(name: str) -> dict[str, str]:
    pins = {}
    for line in (IMAGES / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            [spec] = req.specifier
            assert spec.operator == "==", line
            pins[req.name] = spec.version
    return pins


def test_requirements_pin_pyprojects_dependencies_at_the_tested_versions():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for name, specs in (("requirements.txt", project["dependencies"]),
                        ("requirements-tf.txt", project["optional-dependencies"]["tf"])):
        pins = pinned(name)
        for spec in specs:
            req = Requirement(spec)
            assert req.name in pins, f"{name} lacks {req.name}"
            assert pins[req.name] in req.specifier, (name, req.name, pins[req.name])
        # exactly what this test environment runs
        for dist, version in pins.items():
            installed = md.version(dist)
            assert installed == version, (
                f"{name}: {dist}=={version} but the tests run {installed}; "
                "run `python images/pin.py` in the test environment")


def test_requirements_are_what_pin_py_writes():
    sys.path.insert(0, str(IMAGES))
    try:
        import pin
    finally:
        sys.path.remove(str(IMAGES))
    for name, section in pin.FILES.items():
        assert (IMAGES / name).read_text() == pin.render(section), name


def test_setup_installs_the_pins_as_constraints():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-c \"$repo/images/requirements.txt\"" in setup
    assert "-c \"$repo/images/requirements-tf.txt\"" in setup


def test_images_install_the_pins_and_gpulab(image):
    name, steps = image
    runs = " ".join(args for word, args in steps if word == "RUN")
    assert "-r /tmp/gpulab/requirements.txt" in runs
    if name == "singleuser":
        assert "-r /tmp/gpulab/requirements-tf.txt" in runs
    assert "--no-deps /tmp/gpulab/src" in runs  # gpulab from the repository, nothing re-resolved


def test_images_run_unprivileged(image):
    name, steps = image
    users = [args for word, args in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0"), users


def test_what_the_images_start_exists(image):
    name, steps = image
    scripts = {ep.name for ep in md.entry_points(group="console_scripts")}
    runs = " ".join(args for word, args in steps if word == "RUN")
    for modules in re.findall(r'-c "import ([^"]+)"', runs):
        for module in modules.split(","):
            assert importlib.util.find_spec(module.strip()), f"{name}: no module {module}"
    if name == "singleuser":
        cmd = [args for word, args in steps if word == "CMD"][-1]
        assert cmd == '["jupyterhub-singleuser"]' and "jupyterhub-singleuser" in scripts
        # training replicas run `python -m gpulab.extensions.runtime` in this image
        assert importlib.util.find_spec("gpulab.extensions.runtime")
    else:
        # the chart's hub runs jupyterhub, which loads these from the values' extraConfig
        assert "jupyterhub" in scripts
        from gpulab.hub.deploy.kubernetes import kubernetes_config  # noqa: F401
        from gpulab.spawner.kube import KubeGPUSpawner  # noqa: F401


def test_one_tensorflow_is_installed():
    """gpulab[tf] installs `tensorflow` alone: tensorflow-cpu beside it (tf-keras pulls in
    `tensorflow` by name) made two copies in one folder (issue 14)."""
    assert md.version("tensorflow")
    with pytest.raises(md.PackageNotFoundError):
        md.distribution("tensorflow-cpu")
